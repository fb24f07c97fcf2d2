"""The TRL side of ``rollart bench throughput --trl``: TRL's ``GRPOTrainer`` on the very same model
folder, prompts and reward as the rollart runs, in TRL's own virtual environment (rollart is not
installed there: this file imports only TRL, its dependencies and :mod:`reverse_chat_task`, a file
beside it).

Run as ``PYTHON trl_grpo.py --model DIR --train FILE --out FILE.json [...]``. It writes one JSON
object: per step the mean reward and the wall time of the step (generation, reward, loss, backward and
optimizer step: what TRL's ``training_step`` does), the model-load time, and the TRL version.

The settings match the rollart runs: 32 prompts × 8 samples per optimizer step (one generation per
step, ``num_iterations=1``), temperature 1, no KL (``beta=0``), group-normalised advantages
(``scale_rewards="group"``), token-mean loss (``loss_type="dapo"``: the loss summed over the batch's
completion tokens divided by their number), a constant learning rate with AdamW and gradient clipping
at 1, no gradient checkpointing (TRL's default turns it on; off is faster for a model this small).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reverse_chat_task import score

log = logging.getLogger("trl_grpo")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True, help="JSONL rows with prompt and answer")
    p.add_argument("--out", required=True, help="the JSON report")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """TRL's reward-function form: the completions (messages, for a conversational dataset) and the
    dataset's ``answer`` column."""
    texts = [c[0]["content"] if isinstance(c, list) else str(c) for c in completions]
    return [score(t, a) for t, a in zip(texts, answer)]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    rows = [json.loads(line) for line in Path(args.train).read_text().splitlines() if line.strip()]
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    )
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    batch = args.groups * args.group_size
    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl-output"),
        per_device_train_batch_size=batch,
        num_generations=args.group_size,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        disable_tqdm=True,
    )
    steps: list[dict[str, float]] = []

    class Record(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            steps.append({"step_s": time.perf_counter() - self.t})

        def on_log(self, _args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **k: Any) -> None:
            if logs and "reward" in logs and steps:
                steps[-1]["reward_mean"] = float(logs["reward"])
                steps[-1]["completion_length"] = float(logs.get("completions/mean_length", float("nan")))

    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok, callbacks=[Record()]
    )
    load_s = time.perf_counter() - t0
    trainer.train()
    report = {
        "framework": "trl",
        "version": trl.__version__,
        "torch": torch.__version__,
        "load_s": load_s,
        "samples_per_step": batch,
        "steps": steps,
    }
    Path(args.out).write_text(json.dumps(report))
    log.info("TRL: %d steps written to %s", len(steps), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
