"""The model and data of the throughput comparison (issue #17), built offline and shared by both
frameworks: a Hugging Face folder that rollart and TRL load alike.

- the model: a Qwen2 of 128 hidden, 4 layers, 4 heads, 2 KV heads, 384 intermediate, tied embeddings,
  the built-in character-level byte-BPE tokenizer with the ChatML template (vocabulary under 300);
- a supervised warm-up of ``warmup_steps`` steps (of ``warmup_batch`` examples) on the task in chat form (the prompt rendered with
  the template and the generation prompt, the loss on the answer and ``<|im_end|>``), so that RL starts
  from a model that knows the format, as a user's instruct model would;
- the prompts: ``train.jsonl`` with ``prompt`` and ``answer`` (:mod:`reverse_chat_task`).

The folder is built once per set of arguments under ``root`` and reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from rollart.benchmarks.reverse_chat_task import make_rows

log = logging.getLogger("rollart.bench")

MODEL = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 384}


@dataclass(frozen=True)
class SettingSpec:
    # 300 steps of 256: the 50 steps (of 32 or 256 examples) leave the letters at chance in this
    # model, and then neither framework's GRPO moves the reward at lr 3e-4 (TRL: 0.125 -> 0.129 in 300
    # steps); after 300 x 256 the model samples 36% reward (1.6% exact) and RL has something to climb
    warmup_steps: int = 300
    warmup_batch: int = 256
    warmup_lr: float = 3e-3
    prompts: int = 20000
    seed: int = 0
    quick: bool = False  # a 1-layer model: the bench's smoke mode

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Setting:
    model: Path
    train: Path
    warmup_loss: list[float]


def _corpus() -> list[str]:
    rows = make_rows(2000, seed=12345)
    return [f"{r['prompt']}\n{r['answer']}\n" for r in rows]


def _warm_up(folder: Path, spec: SettingSpec) -> list[float]:
    """Supervised steps on chat-form examples (loss on the answer tokens and the end of turn)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.warmup_lr)
    rng = random.Random(spec.seed + 1)
    rows = make_rows(spec.warmup_steps * spec.warmup_batch, seed=rng.randrange(2**31))
    losses: list[float] = []
    for step in range(spec.warmup_steps):
        batch = rows[step * spec.warmup_batch : (step + 1) * spec.warmup_batch]
        seqs, labels = [], []
        for r in batch:
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True
            )
            p_ids = tok.encode(prompt, add_special_tokens=False)
            a_ids = tok.encode(r["answer"], add_special_tokens=False) + [tok.eos_token_id]
            seqs.append(p_ids + a_ids)
            labels.append([-100] * len(p_ids) + a_ids)
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), tok.pad_token_id)
        lab = torch.full((len(seqs), width), -100)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (s, y) in enumerate(zip(seqs, labels)):
            ids[i, : len(s)], lab[i, : len(y)], mask[i, : len(s)] = torch.tensor(s), torch.tensor(y), 1
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.save_pretrained(str(folder), safe_serialization=True)
    log.info("warm-up: %d supervised steps, loss %.3f -> %.3f", spec.warmup_steps, losses[0], losses[-1])
    return losses


def build_setting(root: str | os.PathLike[str], spec: SettingSpec | None = None) -> Setting:
    """The model folder (warmed up) and the prompts, built once under ``root`` for ``spec``."""
    from rollart.models import build_tiny

    spec = spec or SettingSpec()
    target = Path(root) / f"setting-{spec.key()}"
    if not (target / "setting.json").exists():
        tmp = Path(root) / f"setting-{spec.key()}.building"
        shutil.rmtree(tmp, ignore_errors=True)
        model = {**MODEL, "num_layers": 1} if spec.quick else MODEL
        build_tiny(tmp / "model", corpus=_corpus(), vocab_size=280, chat=True, seed=spec.seed, **model)
        losses = _warm_up(tmp / "model", spec)
        with open(tmp / "train.jsonl", "w") as f:
            for row in make_rows(spec.prompts, seed=spec.seed):
                f.write(json.dumps(row) + "\n")
        (tmp / "setting.json").write_text(json.dumps({"spec": asdict(spec), "warmup_loss": losses}, indent=1))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    meta = json.loads((target / "setting.json").read_text())
    return Setting(model=target / "model", train=target / "train.jsonl", warmup_loss=meta["warmup_loss"])
