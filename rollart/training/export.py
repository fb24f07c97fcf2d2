"""Export a trained policy as a Hugging Face folder (``config.json``, ``model.safetensors``,
tokenizer files, ``generation_config.json``) that ``AutoModelForCausalLM.from_pretrained``, vLLM and
SGLang load.

The weights come in the base model's names (a LoRA run's adapters merged, a megatron run's weights
converted back); config and tokenizer are the base model's.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from rollart.training.checkpoint_io import latest_checkpoint, load_model_state, read_meta

log = logging.getLogger(__name__)


def export_hf(state: dict[str, torch.Tensor], base_model: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write ``state`` (full weights, Hugging Face names) with ``base_model``'s config, tokenizer and
    generation config into ``out`` (replaced atomically: a half-written export is never left there)."""
    from transformers import AutoTokenizer, GenerationConfig

    from rollart.models.shapes import load_causal_lm

    target = Path(out)
    tmp = target.with_name(target.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    model = load_causal_lm(base_model, dtype=torch.float32)
    # strict: every weight of the architecture, nothing else (a tied output layer may be left out)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if _is_tied(model, k)}
    if set(missing) - tied or unexpected:
        raise KeyError(
            f"export: the weights do not fit {base_model}: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.save_pretrained(str(tmp), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base_model)).save_pretrained(str(tmp))
    if not (tmp / "generation_config.json").exists():
        GenerationConfig.from_model_config(model.config).save_pretrained(str(tmp))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    log.info("exported a Hugging Face model to %s", target)
    return target


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "tie_word_embeddings", False)) and key.startswith("lm_head.")


def checkpoint_to_hf_state(path: str | os.PathLike[str], base_model: str | None = None) -> tuple[dict, str]:
    """Full Hugging Face weights of a checkpoint (folder or earlier single file) and its base model
    folder (``base_model`` overrides the one recorded in the checkpoint)."""
    meta = read_meta(path)
    base = base_model or meta.get("base_model")
    if base is None:
        raise ValueError(
            f"{path}: this checkpoint (format {meta['format']}) does not record its base model; "
            "pass --base-model PATH (the Hugging Face folder the run started from)"
        )
    state = load_model_state(path)
    naming = meta.get("weights", "hf")
    if naming == "peft":
        from rollart.training.lora import lora_state_to_hf

        state = lora_state_to_hf(state, base, meta["lora"])
    elif naming == "megatron":
        from transformers import AutoConfig

        from rollart.training.megatron_weights import megatron_to_hf

        state = megatron_to_hf(
            {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, AutoConfig.from_pretrained(base)
        )
    elif naming != "hf":
        raise ValueError(f"{path}: unknown weight naming {naming!r} in meta.json")
    return state, str(base)


def export_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str], base_model: str | None = None) -> Path:
    """Export the latest checkpoint of ``run_dir`` (``RUN_DIR/checkpoint``) as a Hugging Face folder."""
    root = Path(run_dir) / "checkpoint"
    ckpt = latest_checkpoint(root)
    if ckpt is None:
        raise FileNotFoundError(
            f"{run_dir}: no checkpoint under {root} (set checkpoint_every in the config); a finished run's "
            f"final export is {Path(run_dir) / 'hf'}"
        )
    state, base = checkpoint_to_hf_state(ckpt, base_model)
    return export_hf(state, base, out)
