"""The real pipeline under each weight channel, for ``rollart bench weight-sync --pipeline``.

One config (a multi-task asynchronous run, alpha 1, a tiny Qwen2 sized by ``--hidden``/``--layers``)
runs once per mode, changing only ``weights.channel``: ``none`` (no weights move: the baseline),
``mooncake`` (published in the background, one fetch per host, swapped between engine steps) and
``ray`` (blocking: suspend, every worker loads from the object store, resume). Run as a driver
(``python -m rollart.benchmarks.weight_sync_pipeline ...``, e.g. inside the head host of a namespace cluster)
it prints ``RESULT {...}``: per mode, the step times after the warm-up steps and where workers ran.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("rollart.bench")


def bench_config(
    channel: str,
    out: Path,
    *,
    steps: int,
    hidden: int,
    layers: int,
    local: bool,
    sets: dict[str, Any] | None = None,
) -> Any:
    """The run of one mode; ``sets`` are dotted overrides (``{"rollout.group_size": 8}``), the same in every mode."""
    from rollart.config import validate_config

    raw: dict[str, Any] = {
        "name": f"ws-{channel}",
        "pools": {
            # the rollout's compute-class type is not the trainer's, so the trainer always lands on the head
            # host (with H800 on two hosts Ray put it on either, and runs differed by up to 25%)
            "train": {"hardware": "H800", "devices": 1},
            "rollout": [{"hardware": "A800", "devices": 1}, {"hardware": "H20", "devices": 2}],
        },
        "tags": {"reverse-3": ["A800"], "reverse-2": ["H20"]},
        "envs": [
            {"name": "reverse", "groups": 3, "kwargs": {"length": 3}},
            {"name": "reverse", "groups": 3, "kwargs": {"length": 2}},
        ],
        # 48 trajectories a step, trained on in 4 PPO epochs: a step that computes more than it moves
        # (at the tiny model's 15.5 MB, a one-epoch step of 16 trajectories is shorter than the
        # transfer itself, which no overlap can hide; real models train minutes per step)
        "rollout": {"num_env_groups": 6, "group_size": 8, "batch_groups": 6, "alpha": 1},
        "sampling": {"temperature": 1.0, "max_new_tokens": 3},
        "advantage": "grpo_token",
        "tiny_model": {"hidden_size": hidden, "num_layers": layers, "intermediate_size": 4 * hidden},
        "train": {"lr": 0.0005, "ppo_epochs": 4},
        "steps": steps,
        "checkpoint_every": 0,
        "output_dir": str(out / channel),
        "cluster": {"metadata_store": str(out / f"{channel}.sqlite")},
        "weights": {"channel": channel, "segment_mb": 512, "timeout_s": 300},
    }
    if local:
        raw["cluster"]["local_resources"] = {"H800": 1, "A800": 1, "H20": 2, "CPU": 4}
    for dotted, value in (sets or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return validate_config(raw)


def run_mode(
    channel: str,
    out: Path,
    *,
    steps: int,
    warmup: int,
    hidden: int,
    layers: int,
    local: bool,
    sets: dict[str, Any] | None = None,
) -> dict[str, Any]:
    import time

    import ray

    from rollart.benchmarks.cpu_account import CoreSampler
    from rollart.pipelines.agentic import AgenticPipeline

    class StampedPipeline(AgenticPipeline):
        """Each step record carries the moment the step ended (``time.monotonic``), for the CPU window."""

        async def on_step_end(self, step: int, record: dict[str, Any], trajs: list[Any]) -> None:
            record["ended"] = time.monotonic()

    cfg = bench_config(channel, out, steps=steps + warmup, hidden=hidden, layers=layers, local=local, sets=sets)
    pipe = StampedPipeline(cfg, progress=False)
    sampler = CoreSampler().start()
    try:
        history = pipe.run()
        served = [m["weight_version"] for m in pipe.infer.metrics().result()]
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        places = ray.get([w._rollart_info.remote() for w in pipe.train.workers + pipe.infer.workers])
        state_mb = sum(
            t.numel() * t.element_size() for t in ray.get(pipe.train.workers[0].cpu_state_dict.remote()).values()
        ) / (1 << 20)
    finally:
        sampler.stop()
        pipe.shutdown()
    measured = history[warmup:]
    steps_s = [h["time"]["step_s"] for h in measured]
    # the measured steps ran from the end of the last warm-up step (or the first step's start) to the last's end
    start = history[warmup - 1]["ended"] if warmup > 0 else measured[0]["ended"] - steps_s[0]
    cpu = sampler.per_step(start, measured[-1]["ended"], len(measured))
    return {
        "channel": channel,
        "step_s": statistics.mean(steps_s),
        "steps_s": steps_s,
        "train_s": statistics.mean(h["time"]["train_s"] for h in measured),
        "rollout_wait_s": statistics.mean(h["time"]["rollout_wait_s"] for h in measured),
        "driver_sync_wait_s": statistics.mean(h["time"]["weight_sync_s"] for h in measured),
        "weight_load_s": statistics.mean(h["time"]["weight_load_s"] for h in measured),
        "tokens_per_s": sum(h["tokens"] for h in measured) / max(sum(steps_s), 1e-9),
        "max_staleness": max(h["max_staleness"] for h in history),
        "final_versions": served,
        "state_mb": state_mb,
        # per core, ms per measured step: busy (of it system, softirq) and idle (benchmarks.cpu_account)
        "cpu_ms_per_step": {str(core): {k: round(v, 1) for k, v in c.items()} for core, c in cpu.items()},
        "workers": [{"hardware": p["hardware"], "ip": ips.get(p["node_id"], "?")} for p in places],
    }


def _wait_released(timeout_s: float = 180.0) -> None:
    """Until every hardware unit is free again (a finished pipeline's placement groups go away
    asynchronously); the next mode then gets the same placement."""
    import time

    import ray

    if not ray.is_initialized():  # the first mode: the pipeline starts or joins Ray itself
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        total, free = ray.cluster_resources(), ray.available_resources()
        if all(free.get(k, 0.0) >= v for k, v in total.items() if k.startswith("accelerator_type:")):
            return
        time.sleep(0.5)  # polling Ray's resource view; bounded by the deadline
    log.warning("hardware still held %.0f s after the previous run", timeout_s)


def run_modes(
    modes: list[str],
    out: Path,
    *,
    steps: int,
    warmup: int,
    hidden: int,
    layers: int,
    local: bool,
    sets: dict[str, Any] | None = None,
) -> dict[str, Any]:
    results = {}
    for mode in modes:
        _wait_released()
        log.info("weight-sync pipeline: channel %s", mode)
        results[mode] = run_mode(
            mode, out, steps=steps, warmup=warmup, hidden=hidden, layers=layers, local=local, sets=sets
        )
        log.info("weight-sync pipeline: channel %s step %.2f s", mode, results[mode]["step_s"])
    return results


def main(argv: list[str] | None = None) -> int:
    from rollart.config import parse_sets

    p = argparse.ArgumentParser()
    p.add_argument("--modes", default="none,mooncake,ray")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    results = run_modes(
        args.modes.split(","),
        Path(args.out),
        steps=args.steps,
        warmup=args.warmup,
        hidden=args.hidden,
        layers=args.layers,
        local=False,
        sets=parse_sets(args.set),
    )
    print("RESULT " + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
