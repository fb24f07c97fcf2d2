"""LoRA through ``peft`` (extra ``lora``): wrap a Hugging Face model, and merge its adapters into full
weights under the base model's own names for the inference engines and exports."""

from __future__ import annotations

from typing import Any

import torch

from rollart.training.config import LoraSettings

ADAPTER = "default"


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> Any:
    """``model`` wrapped by ``peft.get_peft_model``: only the adapter parameters require gradients."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        target_modules=list(settings.target_modules),
        lora_dropout=settings.dropout,
        bias="none",
    )
    peft_model = get_peft_model(model, cfg, adapter_name=ADAPTER)
    found = [n for n, _ in peft_model.named_modules() if n.endswith(f"lora_A.{ADAPTER}")]
    if not found:
        raise ValueError(f"train.lora.target_modules {settings.target_modules} matched no layer of the model")
    return peft_model


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def merged_state_dict(peft_model: torch.nn.Module, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The full weights ``W + scale * B @ A`` in the base model's names (``...q_proj.weight``), as CPU
    copies (each its own storage); the model itself is not changed (no ``merge_and_unload``)."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.base_model.model  # type: ignore[union-attr]
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in base.state_dict().items():
            if ".lora_" in key:
                continue
            out[key.replace(".base_layer.", ".")] = value.detach().to(device, copy=True)
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                if getattr(module, "merged", False):
                    raise RuntimeError(f"{name}: the LoRA adapter is merged into the layer already")
                key = f"{name}.weight"
                delta = module.get_delta_weight(ADAPTER).detach().to(device)
                out[key] = (out[key].float() + delta.float()).to(out[key].dtype)
    return out


def lora_state_to_hf(
    state: dict[str, torch.Tensor], base_model: str, settings: dict[str, Any] | LoraSettings
) -> dict[str, torch.Tensor]:
    """Merged full weights from a LoRA checkpoint's state dict (peft names)."""
    from rollart.models.shapes import load_causal_lm

    model = load_causal_lm(base_model, dtype=torch.float32)
    peft_model = apply_lora(model, LoraSettings.model_validate(settings))
    peft_model.load_state_dict(state)
    return merged_state_dict(peft_model)
