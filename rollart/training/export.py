"""Export a trained policy as a Hugging Face folder (``config.json``, ``model.safetensors`` or its shards
with ``model.safetensors.index.json``, tokenizer files, ``generation_config.json``) that
``AutoModelForCausalLM.from_pretrained``, vLLM and SGLang load.

The weights come in the base model's names (a LoRA run's adapters merged, a megatron run's weights
converted back); config and tokenizer are the base model's. A trainer exports a bucket at a time
(:class:`HFShardWriter`: one safetensors file per bucket, a tensor larger than a bucket written into a file of
its own piece by piece), and so does ``rollart export`` of a sharded checkpoint: neither holds the whole model
at once.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from rollart.training.checkpoint_io import latest_checkpoint, load_model_state, read_meta
from rollart.weights.stream import Part, TensorPiece

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


# safetensors' names of the dtypes a trainer publishes (the format's header spec)
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class SafetensorsPieceFile:
    """A safetensors file of one tensor written a row range at a time: the header (its name, dtype, shape and
    byte range, which the pieces' full shape gives) first, then the rows in order; what
    ``safetensors.safe_open`` reads back is the whole tensor."""

    def __init__(self, path: Path, key: str, shape: tuple[int, ...], dtype: torch.dtype):
        import json
        import struct

        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"export: {key!r} has dtype {dtype}, which this writer does not write")
        self.key, self.shape, self.dtype = key, tuple(shape), dtype
        numel = 1
        for d in self.shape:
            numel *= d
        self.nbytes = numel * dtype.itemsize
        header = {
            "__metadata__": {"format": "pt"},
            key: {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(self.shape), "data_offsets": [0, self.nbytes]},
        }
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close(), after the last piece)
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self.rows = 0

    def write(self, piece: TensorPiece) -> None:
        if piece.start != self.rows or tuple(piece.shape) != self.shape or piece.data.dtype != self.dtype:
            raise ValueError(f"export: a piece of {self.key!r} at row {piece.start}, expected row {self.rows}")
        data = piece.data.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self.rows = piece.stop

    def close(self) -> int:
        """Close the file once every row is in; returns the tensor's bytes."""
        self._file.close()
        if self.rows != self.shape[0]:
            raise ValueError(f"export: only the first {self.rows} rows of {self.key!r} came")
        return self.nbytes


class HFShardWriter:
    """A Hugging Face folder written a bucket of weights at a time: each :meth:`add` writes one safetensors
    file; :meth:`finish` names them ``model-0000i-of-0000n.safetensors`` (one file: ``model.safetensors``),
    writes the index, the base model's config, tokenizer and generation config, and moves the folder to
    ``out`` (replaced atomically: a half-written export is never left there)."""

    def __init__(self, base_model: str | os.PathLike[str], out: str | os.PathLike[str]):
        self.base_model = str(base_model)
        self.target = Path(out)
        self.tmp = self.target.with_name(self.target.name + ".partial")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.total = 0
        self._open: SafetensorsPieceFile | None = None  # the file of a tensor whose pieces are coming

    def add(self, bucket: Mapping[str, Part]) -> None:
        """Write a bucket's whole tensors as one file; a piece of a tensor larger than a bucket goes into that
        tensor's own file at its rows (:class:`SafetensorsPieceFile`: the file is written piece by piece, the
        tensor is never whole in memory)."""
        from safetensors.torch import save_file

        whole = {k: v.contiguous() for k, v in bucket.items() if not isinstance(v, TensorPiece)}
        for key, piece in bucket.items():
            if isinstance(piece, TensorPiece):
                self._add_piece(key, piece)
        if not whole:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        save_file(whole, str(self.tmp / name), metadata={"format": "pt"})
        self.files.append(name)
        self.weight_map.update(dict.fromkeys(whole, name))
        self.total += sum(v.numel() * v.element_size() for v in whole.values())

    def _add_piece(self, key: str, piece: TensorPiece) -> None:
        if piece.start == 0:
            if self._open is not None:
                raise ValueError(f"export: {key!r} starts before the last rows of {self._open.key!r} came")
            name = f"part-{len(self.files):05d}.safetensors"
            self._open = SafetensorsPieceFile(self.tmp / name, key, piece.shape, piece.data.dtype)
            self.files.append(name)
            self.weight_map[key] = name
        if self._open is None or self._open.key != key:
            raise ValueError(f"export: a piece of {key!r} at row {piece.start} before its first piece")
        self._open.write(piece)
        if piece.last:
            self.total += self._open.close()
            self._open = None

    def finish(self) -> Path:
        import json

        if self._open is not None:
            raise ValueError(f"export: only the first {self._open.rows} rows of {self._open.key!r} came")

        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        n = len(self.files)
        names = {
            f: ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
            for i, f in enumerate(self.files)
        }
        for old, new in names.items():
            os.replace(self.tmp / old, self.tmp / new)
        if n > 1:
            index = {
                "metadata": {"total_size": self.total},
                "weight_map": {k: names[f] for k, f in self.weight_map.items()},
            }
            (self.tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        config = AutoConfig.from_pretrained(self.base_model)
        config.save_pretrained(str(self.tmp))
        AutoTokenizer.from_pretrained(self.base_model).save_pretrained(str(self.tmp))
        try:
            generation = GenerationConfig.from_pretrained(self.base_model)
        except OSError:  # the base folder has none
            generation = GenerationConfig.from_model_config(config)
        generation.save_pretrained(str(self.tmp))
        if self.target.exists():
            shutil.rmtree(self.target)
        os.replace(self.tmp, self.target)
        log.info("exported a Hugging Face model to %s (%d weight files)", self.target, n)
        return self.target


def write_chat_template(folder: str | os.PathLike[str], setting: str) -> str | None:
    """Give the exported model at ``folder`` the chat template a run served with (``serving.chat_template``:
    a Jinja file or inline Jinja; ``auto`` leaves the base tokenizer's own). Returns the template written, so
    ``rollart serve policy`` and other servers of the folder render chats as the run did."""
    from transformers import AutoTokenizer

    from rollart.rollout.chat import resolve_template

    if setting == "auto":
        return None
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    template = resolve_template(tokenizer, setting)
    if template is None:
        return None
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(folder))
    log.info("exported %s with the run's chat template (serving.chat_template)", folder)
    return template


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


def export_sharded_checkpoint(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    base_model: str | None = None,
    bucket_bytes: int = 256 << 20,
) -> Path:
    """A sharded checkpoint (``train.sharding: fsdp``) as a Hugging Face folder, read and written a bucket at a
    time in this process (no process group, never the whole model in memory)."""
    from transformers import AutoConfig

    from rollart.training.sharded_checkpoint import iter_checkpoint_weights

    meta = read_meta(path)
    base = base_model or meta.get("base_model")
    if base is None:
        raise ValueError(f"{path}: the checkpoint does not record its base model; pass --base-model PATH")
    tied = bool(getattr(AutoConfig.from_pretrained(str(base)), "tie_word_embeddings", False))
    writer = HFShardWriter(base, out)
    for bucket in iter_checkpoint_weights(path, bucket_bytes, skip={"lm_head.weight"} if tied else None):
        writer.add(bucket)
    return writer.finish()


def export_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str], base_model: str | None = None) -> Path:
    """Export the latest checkpoint of ``run_dir`` (``RUN_DIR/checkpoint``) as a Hugging Face folder."""
    root = Path(run_dir) / "checkpoint"
    ckpt = latest_checkpoint(root)
    if ckpt is None:
        raise FileNotFoundError(
            f"{run_dir}: no checkpoint under {root} (set checkpoint_every in the config); a finished run's "
            f"final export is {Path(run_dir) / 'hf'}"
        )
    from rollart.training.sharded_checkpoint import is_sharded_checkpoint

    if ckpt.is_dir() and is_sharded_checkpoint(read_meta(ckpt)):
        return export_sharded_checkpoint(ckpt, out, base_model)
    state, base = checkpoint_to_hf_state(ckpt, base_model)
    return export_hf(state, base, out)
