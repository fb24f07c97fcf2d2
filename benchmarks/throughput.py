"""throughput: samples/s and tokens/s of generation and training on reverse-3 in chat form,
synchronous (``alpha: 0``) and asynchronous (``alpha: 1``), the steps and time to a trailing-mean reward
of ``--threshold``, and with ``--trl PYTHON`` TRL's ``GRPOTrainer`` on the same setting beside them.

The setting of issue #17 (:mod:`reverse_chat`, :mod:`reverse_chat_task`): a Qwen2 built locally (128
hidden, 4 layers, 4 heads, 2 KV heads, 384 intermediate, tied embeddings, the character-level byte-BPE
tokenizer with the ChatML template, 260 tokens) warmed up with 50 supervised steps; ``Reverse: abc`` →
``cba``, reward 1 for the exact answer, else 0.8·(letters in place)/3 + 0.1·(stop after 3); 32 prompts
× 8 samples per step, temperature 1, at most 8 new tokens, sequence-level GRPO, token-mean loss, one
optimizer step per batch, lr 3e-4. rollart runs it as a dataset task (``data:`` with the task's
verifier) with the model's own chat template, the torch engine, one trainer and one inference worker;
each mode is one ``AgenticPipeline`` run on a fresh local Ray. Its figures come from the per-step
metrics (the first ``--skip`` steps, with their start-up costs, are left out):

- generation: samples (and output tokens) per second of rollout wait — the time the trainer waited for
  a batch; in ``alpha: 1`` generation overlaps training, so this is what was not hidden;
- training: samples (and trained tokens) per second of ``train_s``;
- end to end: samples per second of step time.

TRL's figures come from :mod:`trl_grpo`, run by the given interpreter (TRL's own virtual environment)
once per ``--trl-threads`` value: samples per second of its step time (generation, reward and the
optimizer step, one process), with the same ``--skip``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

from rollart.benchmarks.common import run_pipeline_once, write_report
from rollart.benchmarks.quickstart import summarise
from rollart.benchmarks.reverse_chat import MODEL, Setting, SettingSpec, build_setting

log = logging.getLogger("rollart.bench")

MAX_NEW_TOKENS = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=300, help="steps per mode (the cap on steps to the threshold)")
    p.add_argument("--alphas", default="0,1", help="comma-separated asynchronous bounds to run, e.g. 0,1")
    p.add_argument("--groups", type=int, default=32, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--window", type=int, default=20, help="steps in the trailing mean of the reward")
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the throughput figures")
    p.add_argument(
        "--trl",
        metavar="PYTHON",
        help="the interpreter of a virtual environment with TRL (e.g. .venv-trl/bin/python): run TRL's "
        "GRPOTrainer on the same setting beside rollart",
    )
    p.add_argument("--trl-threads", default="1,2", help="torch threads of the TRL runs, one run per value")
    p.add_argument("--no-rollart", action="store_true", help="run only the TRL side (with --trl)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value of the rollart runs"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of both frameworks' runs (sampling, data order, initialisation)"
    )
    p.add_argument("--quick", action="store_true", help="smoke test: 3 steps, 4 prompts x 4 samples, a 1-layer model")
    p.add_argument("--out", default="runs/bench/throughput")


def setting_spec(args: argparse.Namespace) -> SettingSpec:
    return SettingSpec(warmup_steps=2, prompts=256, quick=True) if args.quick else SettingSpec()


def mode_config(args: argparse.Namespace, setting: Setting, alpha: int, out_dir: Path) -> dict[str, Any]:
    """The overrides of ``pipelines/quickstart.yaml`` for one mode (dotted keys)."""
    return {
        "name": f"throughput-a{alpha}",
        "steps": args.steps,
        "model": str(setting.model.resolve()),
        "envs": [],
        "data": {
            "train": str(setting.train.resolve()),
            "verifier": "rollart.benchmarks.reverse_chat_task:score",
            "inline_verifier": True,  # quick pure Python: scored on the rollout's event loop
            "tag": "reverse-chat",
            "groups": args.groups,
        },
        "rollout.num_env_groups": args.groups,
        "rollout.group_size": args.group_size,
        "rollout.batch_groups": args.groups,
        "rollout.alpha": alpha,
        "sampling": {"temperature": 1.0, "max_new_tokens": MAX_NEW_TOKENS, "seed": args.seed},
        "seed": args.seed,
        "advantage": "grpo",
        # asynchronous runs train on samples up to alpha versions old: the decoupled objective (ROLL Flash
        # §2.2) centres the trust region on the trainer's policy and weights each token by pi_old / mu
        "train.loss": "decoupled_ppo" if alpha > 0 else "ppo",
        "train.lr": 3e-4,
        "train.entropy_coef": 0.0,
        "train.loss_agg": "token-mean",
        "checkpoint_every": 0,
        "output_dir": str(out_dir),
    }


def throughput(history: list[dict[str, Any]], skip: int) -> dict[str, float]:
    """Samples/s and tokens/s of generation (per second of rollout wait), training and end to end, and
    where a step's time went: rollout wait, train, weight sync, and the rest, the driver's own work
    between them (building the batch and its advantages, the step record)."""
    rows = history[skip:] if len(history) > skip else history
    samples = sum(float(h["train"]["rows"]) for h in rows)
    gen_tokens = sum(float(h["tokens"]) for h in rows)
    train_tokens = sum(float(h["train"]["tokens"]) for h in rows)
    wait = sum(float(h["time"]["rollout_wait_s"]) for h in rows)
    train = sum(float(h["time"]["train_s"]) for h in rows)
    step = sum(float(h["time"]["step_s"]) for h in rows)
    sync = sum(float(h["time"].get("weight_sync_s", 0.0)) for h in rows)

    def per(x: float, t: float) -> float:
        return x / t if t > 0 else float("nan")

    return {
        "steps_measured": len(rows),
        "generation_samples_per_s": per(samples, wait),
        "generation_tokens_per_s": per(gen_tokens, wait),
        "train_samples_per_s": per(samples, train),
        "train_tokens_per_s": per(train_tokens, train),
        "samples_per_s": per(samples, step),
        "rollout_wait_s_per_step": per(wait, len(rows)),
        "train_s_per_step": per(train, len(rows)),
        "weight_sync_s_per_step": per(sync, len(rows)),
        "driver_s_per_step": per(step - wait - train - sync, len(rows)),
        "step_s": per(step, len(rows)),
    }


def _run_mode(args: argparse.Namespace, setting: Setting, alpha: int) -> tuple[list[dict[str, Any]], float]:
    from rollart.config import load_config, parse_sets

    overrides = {**mode_config(args, setting, alpha, Path(args.out) / f"alpha{alpha}"), **parse_sets(args.set)}
    return run_pipeline_once(load_config("pipelines/quickstart.yaml", overrides))


def _learning(rewards: list[float], step_s: list[float], args: argparse.Namespace) -> dict[str, Any]:
    learnt = summarise(rewards, window=args.window, threshold=args.threshold)
    to = learnt["steps_to_threshold"]
    return {**learnt, "time_to_threshold_s": None if to is None else sum(step_s[: to + 1])}


def trl_command(args: argparse.Namespace, setting: Setting, out: Path) -> list[str]:
    script = Path(__file__).with_name("trl_grpo.py")
    return [
        str(args.trl),
        str(script),
        f"--model={setting.model}",
        f"--train={setting.train}",
        f"--out={out}",
        f"--steps={args.steps}",
        f"--groups={args.groups}",
        f"--group-size={args.group_size}",
        f"--max-new-tokens={MAX_NEW_TOKENS}",
        "--lr=3e-4",
        f"--seed={args.seed}",
    ]


def run_trl(args: argparse.Namespace, setting: Setting, threads: int) -> dict[str, Any]:
    """One TRL run in its own interpreter; its per-step records summarised like rollart's."""
    out = Path(args.out) / f"trl-t{threads}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    log.info("TRL with %d thread(s): %s", threads, " ".join(trl_command(args, setting, out)))
    done = subprocess.run(trl_command(args, setting, out), env=env, capture_output=True, text=True)
    (Path(args.out) / f"trl-t{threads}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(
            f"the TRL run failed (exit {done.returncode}); its log: {Path(args.out) / f'trl-t{threads}.log'}"
        )
    report = json.loads(out.read_text())
    rows = report["steps"]
    measured = rows[args.skip :] if len(rows) > args.skip else rows
    seconds = sum(r["step_s"] for r in measured)
    samples = report["samples_per_step"] * len(measured)
    rewards = [float(r.get("reward_mean", float("nan"))) for r in rows]
    return {
        "version": report["version"],
        "threads": threads,
        "steps_measured": len(measured),
        "samples_per_s": samples / seconds if seconds > 0 else float("nan"),
        "step_s": seconds / max(len(measured), 1),
        **_learning(rewards, [r["step_s"] for r in rows], args),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.steps, args.groups, args.group_size, args.skip, args.window = 3, 4, 4, 1, 2
    alphas = [] if args.no_rollart else [int(a) for a in str(args.alphas).split(",") if a.strip()]
    if (not alphas and not args.no_rollart) or any(a < 0 for a in alphas) or args.steps < 1:
        raise SystemExit(f"--alphas must list bounds >= 0 and --steps be >= 1, got {args.alphas!r}, {args.steps}")
    if args.no_rollart and not args.trl:
        raise SystemExit("--no-rollart runs only the TRL side: give --trl PYTHON too")
    if args.trl and not Path(args.trl).exists():
        raise SystemExit(
            f"--trl {args.trl}: no such interpreter; make TRL's environment first: python3 -m venv .venv-trl && "
            ".venv-trl/bin/pip install -c constraints/cpu.txt trl==1.16.0"
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    setting = build_setting(Path(args.out) / "setting", setting_spec(args))
    model = {**MODEL, "num_layers": 1} if args.quick else MODEL
    result: dict[str, Any] = {
        "bench": "throughput",
        "model": model,
        "groups": args.groups,
        "seed": args.seed,
        "group_size": args.group_size,
        "warmup_loss": [setting.warmup_loss[0], setting.warmup_loss[-1]],
    }
    bars: dict[str, float] = {}
    for alpha in alphas:
        history, wall = _run_mode(args, setting, alpha)
        rewards = [float(h["reward_mean"]) for h in history]
        steps_time = [float(h["time"]["step_s"]) for h in history]
        mode = {**throughput(history, args.skip), **_learning(rewards, steps_time, args), "wall_s": wall}
        result[f"alpha {alpha}"] = mode
        bars[f"rollart alpha {alpha}"] = mode["samples_per_s"]
        log.info("alpha %d: %s", alpha, mode)
    if args.trl:
        for threads in [int(t) for t in str(args.trl_threads).split(",") if t.strip()]:
            trl = run_trl(args, setting, threads)
            result[f"trl {threads}t"] = trl
            bars[f"TRL {threads} thread(s)"] = trl["samples_per_s"]
            log.info("TRL, %d thread(s): %s", threads, trl)
    for name, value in bars.items():  # the table's rows: one figure per run
        result[f"samples/s {name}"] = round(value, 1)
    trl_best = max((v for k, v in bars.items() if k.startswith("TRL")), default=None)
    if trl_best:
        for alpha in alphas:
            result[f"rollart alpha {alpha} / best TRL"] = round(bars[f"rollart alpha {alpha}"] / trl_best, 2)
    return write_report(
        args.out, "throughput", result, bars, "samples/s (end to end)", "rollart bench throughput: reverse-3 chat, 32x8"
    )
