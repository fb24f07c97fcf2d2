"""weight-sync: Mooncake asynchronous publish/fetch vs a blocking transfer (RollArt paper §7.3: 1.10–1.16×).

Both modes run the same loop with real components: inference workers (simulated engine, so the CPU is
left to the transfers) keep ``--in-flight`` requests generating through the LLMProxy while a trainer
actor "trains" for ``--train-s`` seconds per step (a sleep standing for the optimiser step) and then
ships a snapshot of ``--model-mb`` MB of real tensors:

- blocking: ``suspend`` → the trainer puts the snapshot in the Ray object store → every worker loads
  it → ``resume``; the trainer waits for all of it (the step time includes the transfer, generation
  is paused during it);
- mooncake: the trainer copies the snapshot and writes it to a Mooncake store in the background
  (``publish_async``) and starts its next step; every worker fetches it while still generating, checks
  its checksum and swaps it in between two engine steps (only the swap pauses that worker).

Reported: mean step time of each mode and their ratio, rollout tokens/s in each, and the store's
publish and fetch bandwidth measured on the same snapshot. Ideal ratio for the blocking transfer time
``S`` per step: ``(train_s + S) / max(train_s, copy time)``.

``--pipeline`` measures the real pipeline instead (:mod:`benchmarks.weight_sync_pipeline`): the same
asynchronous multi-task run (real trainer, torch engine) once per weight channel — ``none`` (no
transfer, the baseline), ``mooncake`` and the blocking ``ray`` transfer — and reports each mean step
time and its ratio to ``none`` (target for mooncake: at most 1.05). ``--hosts 3`` runs it on a
three-host namespace cluster (``rollart.testing.hosts``; needs root): the driver and the trainer on
the head, rollout on H800 and H20 hosts, so every transfer crosses hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from rollart.benchmarks.common import log, write_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-mb", type=int, default=64, help="snapshot size in MB (real tensors)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--train-s", type=float, default=3.0, help="seconds of (simulated) training per step")
    p.add_argument("--workers", type=int, default=2, help="inference workers")
    p.add_argument("--in-flight", type=int, default=16, help="generate requests kept in flight")
    p.add_argument("--decode-step", type=float, default=0.01, help="real seconds per simulated decode step")
    p.add_argument("--out", default="runs/bench/weight-sync")
    p.add_argument("--json", action="store_true")
    p.add_argument("--pipeline", action="store_true", help="measure the real pipeline per weight channel")
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        choices=(0, 3),
        help="--pipeline: 3 runs it on a three-host namespace cluster (root); 0 on a local Ray",
    )
    p.add_argument("--modes", default="none,mooncake,ray", help="--pipeline: weight channels, in run order")
    p.add_argument("--warmup", type=int, default=2, help="--pipeline: first steps not counted")
    p.add_argument("--hidden", type=int, default=256, help="--pipeline: tiny model hidden size")
    p.add_argument("--layers", type=int, default=4, help="--pipeline: tiny model layers")
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--hosts 3: the trainer's host on half the cores, the rollout hosts on the other half",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="--pipeline: override a config value"
    )


def _trainer_class() -> Any:
    import ray
    import torch

    @ray.remote(num_cpus=0)
    class Trainer:
        """Holds a snapshot of ``mb`` MB; ``train`` sleeps (the optimiser step) and changes the weights."""

        def __init__(self, mb: int):
            n = mb * (1 << 20) // 4 // 8
            self.state = {f"layers.{i}.weight": torch.randn(n) for i in range(8)}
            self.version = 0
            self._pending = None

        def train(self, seconds: float) -> int:
            time.sleep(seconds)
            self.state["layers.0.weight"].add_(1e-3)
            self.version += 1
            return self.version

        def publish_ray(self) -> list:
            return [ray.put(self.state), self.version]

        def publish_mooncake(self, channel: Any) -> float:
            """Copy the snapshot and write it in the background; returns the seconds this call blocked."""
            t0 = time.monotonic()
            if self._pending is not None:
                self._pending.result()
            self._pending = channel.publish_async(self.state, self.version)
            return time.monotonic() - t0

        def bandwidth(self, channel: Any, version: int) -> float:
            t0 = time.monotonic()
            nbytes = channel.publish(self.state, version)
            return nbytes / (time.monotonic() - t0)

    return Trainer


async def _generate_forever(proxy: Any, stop: asyncio.Event, counter: list[int], tag: str) -> None:
    from rollart.engines.base import SamplingParams
    from rollart.rollout.types import GenerateRequest

    i = 0
    while not stop.is_set():
        i += 1
        req = GenerateRequest(
            request_id=f"{tag}-{i}", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=64)
        )
        out = await proxy.generate(req, "x")
        counter[0] += len(out.output_token_ids)


async def _run_mode(
    mode: str, args: argparse.Namespace, cluster: Any, proxy: Any, trainer: Any, channel: Any
) -> dict[str, Any]:
    stop = asyncio.Event()
    tokens = [0]
    gens = [asyncio.ensure_future(_generate_forever(proxy, stop, tokens, f"{mode}{j}")) for j in range(args.in_flight)]
    steps, blocked = [], []
    loading: asyncio.Future | None = None
    t_start = time.monotonic()
    for step in range(args.steps + 1):  # step 0 warms the path up (first put, first client) and is not counted
        if step == 1:
            tokens[0], t_start = 0, time.monotonic()
        t0 = time.monotonic()
        version = await trainer.train.remote(args.train_s)
        if mode == "blocking":
            t1 = time.monotonic()
            await proxy.suspend()
            ref, version = await trainer.publish_ray.remote()
            await proxy.model_update(ref, version)
            await proxy.resume()
            blocked.append(time.monotonic() - t1)
        else:
            if loading is not None:
                await loading  # one version in flight at a time
            blocked.append(await trainer.publish_mooncake.remote(channel))
            loading = asyncio.ensure_future(proxy.model_update_from(channel, version))
        steps.append(time.monotonic() - t0)
        log.info("weight-sync %s: version %d, step %.2f s", mode, version, steps[-1])
    if loading is not None:
        await loading
    elapsed = time.monotonic() - t_start
    stop.set()
    await asyncio.gather(*gens)
    served = [m["weight_version"] for m in await cluster.metrics()]
    steps, blocked = steps[1:], blocked[1:]
    return {
        "step_s": statistics.mean(steps),
        "steps_s": steps,
        "trainer_blocked_s": statistics.mean(blocked),
        "tokens_per_s": tokens[0] / elapsed,
        "final_versions": served,
    }


def split_cores(pin: bool) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """``--pin``: the trainer's host gets the first half of this machine's cores, the rollout hosts
    share the other half (separate machines do not slow each other down; hosts sharing every core of
    one machine do). None, None without ``--pin`` or with a single core."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < 2:
        return None, None
    half = len(cores) // 2
    return tuple(cores[:half]), tuple(cores[half:])


def cpu_line(cores: dict[str, dict[str, float]], core_hosts: dict[str, list[str]]) -> str:
    """One mode's CPU per measured step, per core and the hosts pinned to it: "core 0 (head): busy 301
    ms (system 8, softirq 2), idle 0 ms; ..."."""
    parts = []
    for core, c in sorted(cores.items(), key=lambda kv: int(kv[0])):
        hosts = f" ({', '.join(core_hosts[core])})" if core in core_hosts else ""
        parts.append(
            f"core {core}{hosts}: busy {c['busy']:.0f} ms (system {c['system']:.0f}, softirq {c['softirq']:.0f}), "
            f"idle {c['idle']:.0f} ms"
        )
    return "; ".join(parts) + " per step" if parts else "no /proc/stat"


def _run_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    from pathlib import Path

    from rollart.benchmarks.weight_sync_pipeline import run_modes
    from rollart.config import parse_sets

    out = Path(args.out).resolve()
    where = "local Ray"
    core_hosts: dict[str, list[str]] = {}  # core -> the namespace hosts pinned to it
    if args.hosts:
        from rollart.testing import HostSpec, start_hosts

        repo = Path(__file__).resolve().parents[1]
        train_cpus, rollout_cpus = split_cores(args.pin)
        specs = [
            HostSpec("head", {"H800": 1}, num_cpus=2, cpus=train_cpus),
            HostSpec("b", {"A800": 1}, num_cpus=2, cpus=rollout_cpus),
            HostSpec("c", {"H20": 2}, num_cpus=2, cpus=rollout_cpus),
        ]
        with start_hosts(specs, start_timeout_s=300) as cluster:
            res = cluster.run_driver(
                [
                    "-m",
                    "rollart.benchmarks.weight_sync_pipeline",
                    "--modes",
                    args.modes,
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                    "--hidden",
                    str(args.hidden),
                    "--layers",
                    str(args.layers),
                    "--out",
                    str(out / "runs"),
                    *[f"--set={item}" for item in args.set],
                ],
                cwd=repo,
                env={"PYTHONPATH": str(repo)},
                timeout=3600,
            ).check()
            modes = res.result
            for h in cluster.hosts:
                for core in h.cpus or ():
                    core_hosts.setdefault(str(core), []).append(h.name)
            where = f"{len(specs)} namespace hosts " + ", ".join(
                f"{h.name}={h.ip}" + (f" (cores {','.join(map(str, h.cpus))})" if h.cpus else "") for h in cluster.hosts
            )
    else:
        modes = run_modes(
            args.modes.split(","),
            out / "runs",
            steps=args.steps,
            warmup=args.warmup,
            hidden=args.hidden,
            layers=args.layers,
            local=True,
            sets=parse_sets(args.set),
        )
    assert isinstance(modes, dict)
    base = modes.get("none", {}).get("step_s")
    result: dict[str, Any] = {
        "bench": "weight-sync",
        "pipeline": True,
        "where": where,
        "steps": args.steps,
        "warmup": args.warmup,
        "set": list(args.set),
        "modes": modes,
    }
    for mode, m in modes.items():
        result[f"{mode}_step_s"] = m["step_s"]
        if base:
            result[f"{mode}_vs_none"] = m["step_s"] / base
        result[f"{mode}_cpu"] = cpu_line(m.get("cpu_ms_per_step", {}), core_hosts)
    state_mb = next(iter(modes.values()))["state_mb"] if modes else 0.0
    title = ", ".join(f"{k} {v['step_s']:.2f}s" for k, v in modes.items())
    return write_report(
        args.out,
        "weight_sync_pipeline",
        result,
        {k: v["step_s"] for k, v in modes.items()},
        "step time (s)",
        f"pipeline weight sync, {state_mb:.0f} MB: {title}",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "pipeline", False):
        return _run_pipeline(args)
    import ray

    from rollart.benchmarks.common import start_inference
    from rollart.rollout.llm_proxy import LLMProxy
    from rollart.weights.mooncake_channel import MooncakeChannel, close_clients
    from rollart.weights.mooncake_master import MooncakeMaster

    master = MooncakeMaster().start()
    rm = None
    try:
        rm, cluster = start_inference(
            {"rollout": {"hardware": "H20", "devices": args.workers}},
            {"*": ["H20"]},
            {"decode_base_s": args.decode_step, "decode_per_seq_s": 0.0, "prefill_per_token_s": 0.0, "vocab_size": 60},
            name="ws_infer",
        )
        proxy = LLMProxy(cluster)
        trainer = _trainer_class().remote(args.model_mb)
        segment = max(64, 3 * args.model_mb)
        channel = MooncakeChannel("weight-sync-bench", master.address, keep=2, segment_mb=segment, timeout_s=300)

        async def both() -> dict[str, Any]:
            return {
                "blocking": await _run_mode("blocking", args, cluster, proxy, trainer, channel),
                "mooncake": await _run_mode("mooncake", args, cluster, proxy, trainer, channel),
            }

        modes = asyncio.run(both())
        put_bps = ray.get(trainer.bandwidth.remote(channel, 10_000))
        t0 = time.monotonic()
        state = channel.fetch(10_000)
        get_bps = sum(t.numel() * t.element_size() for t in state.values()) / (time.monotonic() - t0)
        t0 = time.monotonic()
        ref = ray.get(trainer.publish_ray.remote())[0]
        ray.get(ref)
        ray_bps = args.model_mb * (1 << 20) / (time.monotonic() - t0)
        cluster.shutdown()
        close_clients()
    finally:
        if rm is not None:
            rm.shutdown()
        master.stop()
    b, m = modes["blocking"], modes["mooncake"]
    speedup = b["step_s"] / m["step_s"]
    ideal = (args.train_s + b["trainer_blocked_s"]) / max(args.train_s, m["trainer_blocked_s"])
    result = {
        "bench": "weight-sync",
        "model_mb": args.model_mb,
        "train_s": args.train_s,
        "workers": args.workers,
        "blocking_step_s": b["step_s"],
        "mooncake_step_s": m["step_s"],
        "speedup": speedup,
        "ideal": ideal,
        "blocking_transfer_s": b["trainer_blocked_s"],
        "mooncake_trainer_blocked_s": m["trainer_blocked_s"],
        "blocking_tokens_per_s": b["tokens_per_s"],
        "mooncake_tokens_per_s": m["tokens_per_s"],
        "mooncake_publish_MBps": put_bps / (1 << 20),
        "mooncake_fetch_MBps": get_bps / (1 << 20),
        "ray_put_get_MBps": ray_bps / (1 << 20),
        "modes": modes,
        "paper_figure": "1.10-1.16x (RollArt paper §7.3)",
    }
    return write_report(
        args.out,
        "weight_sync",
        result,
        {"blocking": b["step_s"], "mooncake async": m["step_s"]},
        "step time (s)",
        f"weight sync, {args.model_mb} MB: {speedup:.2f}x (ideal {ideal:.2f}x)",
    )
