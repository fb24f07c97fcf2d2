"""env-service: env calls over the session protocol under injected failures, with redundant env groups
off and on (RollArt paper §2.2 Fig. 3, §8).

Env servers (``rollart.envservice``, uvicorn in threads on 127.0.0.1) serve :class:`FaultyServiceEnv`:
every reset and step waits ``N(mean, std)`` seconds; a reset fails with ``p_reset_fail`` (an env
error) or is fail-slow with ``p_slow`` (it outlasts the call timeout: 504, the session ends); a step
fails with ``p_step_fail``. In front of each server a lossy TCP proxy drops the answer of a call with
``p_drop`` after the server applied it (the client resends the same seq; the server answers from the
stored result). The real scheduler and EnvManagers run episodes (reset, ``turns`` steps) on
:class:`~rollart.envservice.RemoteEnv`\\ s; generation is instant (no model), so the time is the envs'.

Reported per configuration (baseline ``batch_groups x group_keep`` envs, redundant
``num_env_groups x group_size``): the time to collect one batch, the success rate and p50/p99 latency
of resets and steps as the EnvManager saw them (a retried call counts once per attempt; a dropped
answer that the client recovered counts as one success), trajectories failed, answers dropped and
replayed. The batch time is dominated by resets that time out (RollArt paper Fig. 3: env.reset takes 78%
of the rollout time in failing iterations); redundant groups hide them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time
from typing import Any

import numpy as np

from rollart.benchmarks.common import write_report
from rollart.envs.base import EnvError, TextEnv

log = logging.getLogger(__name__)
_RNG = random.Random(0)
_MODEL: dict[str, float] = {}


class FaultyServiceEnv(TextEnv):
    """A multi-turn env with latency and failures drawn from the bench's model (module globals: the
    servers run in the bench's process)."""

    tag = "faulty"
    max_steps = 2
    max_new_tokens = 2

    def __init__(self, turns: int = 2):
        self.max_steps, self.t = turns, 0

    async def _wait(self, factor: float = 1.0) -> None:
        await asyncio.sleep(max(0.0, _RNG.gauss(_MODEL["mean"], _MODEL["std"])) * factor)

    async def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        draw = _RNG.random()
        if draw < _MODEL["p_slow"]:
            await self._wait(_MODEL["slow_factor"])  # outlasts the call timeout
        else:
            await self._wait()
        if draw > 1 - _MODEL["p_reset_fail"]:
            raise EnvError("injected reset failure")
        self.t = 0
        return f"s{seed}:", {}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        await self._wait()
        if _RNG.random() < _MODEL["p_step_fail"]:
            raise EnvError("injected step failure")
        self.t += 1
        return f"o{self.t}:", 1.0, self.t >= self.max_steps, False, {}


class LossyProxy:
    """TCP proxy on 127.0.0.1 to ``port``: each answer is dropped (the client's connection closed with
    nothing sent) with probability ``p_drop``, after the server sent it."""

    def __init__(self, port: int, p_drop: float, rng: random.Random):
        self.port, self.p_drop, self.rng = port, p_drop, rng
        self.dropped = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._pipe(reader, writer)
        except (asyncio.CancelledError, ConnectionError):  # the bench is ending, or a side hung up
            writer.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.port)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, lossy: bool) -> None:
            while data := await src.read(65536):
                if lossy and self.rng.random() < self.p_drop:
                    self.dropped += 1
                    writer.transport.abort()
                    return
                dst.write(data)
                await dst.drain()

        tasks = [asyncio.ensure_future(pump(reader, up_w, False)), asyncio.ensure_future(pump(up_r, writer, True))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        writer.transport.abort()
        up_w.close()


class _Timed:
    """Records the outcome and latency of every reset/step the EnvManager makes on ``env``."""

    def __init__(self, env: Any, calls: list[tuple[str, bool, float]]):
        self.env, self.calls = env, calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    async def _timed(self, op: str, coro: Any) -> Any:
        t0 = time.perf_counter()
        try:
            out = await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            self.calls.append((op, False, time.perf_counter() - t0))
            raise
        self.calls.append((op, True, time.perf_counter() - t0))
        return out

    async def reset(self, seed: int | None = None) -> Any:
        return await self._timed("reset", self.env.reset(seed))

    async def step(self, action: str) -> Any:
        return await self._timed("step", self.env.step(action))


class _InstantProxy:
    """An LLMProxy stand-in that answers every turn at once (the bench measures the envs); it measures no
    worker time, so it charges no cost."""

    async def generate(self, request: Any, tag: str, *, trace: Any = None, cost: Any = None) -> Any:
        from rollart.rollout.types import GenerateOutput

        return GenerateOutput(
            request_id=request.request_id,
            output_token_ids=[5, 6],
            output_logprobs=[-0.1, -0.1],
            token_versions=[0, 0],
            finish_reason="stop",
        )

    async def abort(self, request_ids: list[str]) -> None:
        return None


class _Codec:
    eos_token_id: int | None = 0

    def encode(self, text: str) -> list[int]:
        return [2 + ord(c) % 60 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline", default="8x4", help="num_env_groups x group_size without redundancy")
    p.add_argument("--redundant", default="10x6", help="num_env_groups x group_size with redundancy")
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--group-keep", type=int, default=4)
    p.add_argument("--servers", type=int, default=4, help="env servers (sessions spread by least sessions)")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--mean", type=float, default=0.2, help="seconds per env call")
    p.add_argument("--std", type=float, default=0.1)
    p.add_argument("--p-reset-fail", type=float, default=0.05)
    p.add_argument("--p-slow", type=float, default=0.05, help="a reset that outlasts --call-timeout")
    p.add_argument("--slow-factor", type=float, default=50.0)
    p.add_argument("--p-step-fail", type=float, default=0.01)
    p.add_argument("--p-drop", type=float, default=0.05, help="an answer lost after the server applied the call")
    p.add_argument("--call-timeout", type=float, default=2.0, help="seconds: a call past it is a 504")
    p.add_argument("--repeats", type=int, default=2, help="batches per configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/env-service", help="output folder for JSON and PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _shape(text: str) -> tuple[int, int]:
    g, s = text.lower().split("x")
    return int(g), int(s)


def _summary(calls: list[tuple[str, bool, float]], op: str) -> dict[str, float]:
    mine = [c for c in calls if c[0] == op]
    lat = np.array([c[2] for c in mine if c[1]]) * 1000
    return {
        "calls": len(mine),
        "success_rate": sum(c[1] for c in mine) / max(1, len(mine)),
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan"),
    }


async def _measure(args: argparse.Namespace, urls: list[str], shape: tuple[int, int]) -> dict[str, Any]:
    from rollart.cluster.serverless import RetryPolicy
    from rollart.envservice import RemoteEnv, ServerPool
    from rollart.rollout.config import EnvManagerConfig, RolloutConfig
    from rollart.rollout.env_manager import EnvManager
    from rollart.rollout.scheduler import RolloutScheduler

    env_name = "rollart.benchmarks.env_service:FaultyServiceEnv"
    pool = ServerPool("faulty", urls, retry=RetryPolicy(retries=4, backoff_base_s=0.02, backoff_max_s=0.5))
    description = await pool.describe(env_name, {"turns": args.turns})
    calls: list[tuple[str, bool, float]] = []
    mcfg = EnvManagerConfig(reset_retries=3, reset_backoff_s=0.02, step_retries=0, step_timeout_s=30)
    groups, size = shape
    managers = [
        [
            EnvManager(
                _Timed(
                    RemoteEnv(pool, env_name, description, kwargs={"turns": args.turns}, timeout_s=args.call_timeout),
                    calls,
                ),
                _InstantProxy(),
                _Codec(),
                config=mcfg,
            )
            for _ in range(size)
        ]
        for _ in range(groups)
    ]
    cfg = RolloutConfig(
        num_env_groups=groups,
        group_size=size,
        group_keep=args.group_keep,
        batch_groups=args.batch_groups,
        alpha=0,
        max_round_failures=100,
    )
    times: list[float] = []
    counts: dict[str, int] = {}
    try:
        for _ in range(args.repeats):  # a fresh scheduler per batch, the same sessions (reset per episode)
            sched = RolloutScheduler(managers, cfg)
            t0 = time.monotonic()
            sched.start()
            batch = await sched.get_batch()
            times.append(time.monotonic() - t0)
            # group loops still waiting for admission do not wake on stop (the scheduler's stop then waits
            # its whole timeout before cancelling them): no round is in flight there, so wait briefly
            await sched.stop(timeout_s=5.0)
            log.info("batch in %.2fs", times[-1])
            assert len(batch) == args.batch_groups and all(len(g) == args.group_keep for g in batch)
            assert all(t.status == "ok" and t.reward == float(args.turns) for g in batch for t in g)
            for k, v in sched.counts.items():
                counts[k] = counts.get(k, 0) + v
    finally:
        for group in managers:
            for m in group:
                await m.env.env.aclose()
    return {
        "batch_s": float(np.mean(times)),
        "reset": _summary(calls, "reset"),
        "step": _summary(calls, "step"),
        "counts": counts,
    }


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart.envservice.server import EnvServerSettings, ThreadedServer, build_env_app

    env_name = "rollart.benchmarks.env_service:FaultyServiceEnv"
    servers = [
        ThreadedServer(build_env_app({env_name: env_name}, EnvServerSettings())).start() for _ in range(args.servers)
    ]
    proxies = [LossyProxy(s.port, args.p_drop, random.Random(args.seed + i)) for i, s in enumerate(servers)]
    try:
        urls = [await p.start() for p in proxies]
        out: dict[str, Any] = {}
        for label, shape in (("baseline", _shape(args.baseline)), ("redundant", _shape(args.redundant))):
            log.info("measuring %s (%s)", label, shape)
            out[label] = await _measure(args, urls, shape)
        out["answers_dropped"] = sum(p.dropped for p in proxies)
        return out
    finally:
        for p in proxies:
            await p.stop()
        for s in servers:
            s.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    for noisy in ("httpx", "rollart.envservice.client", "rollart.rollout.env_manager"):  # a line per call
        logging.getLogger(noisy).setLevel(logging.WARNING)
    _RNG.seed(args.seed)
    _MODEL.update(
        mean=args.mean,
        std=args.std,
        p_reset_fail=args.p_reset_fail,
        p_slow=args.p_slow,
        slow_factor=args.slow_factor,
        p_step_fail=args.p_step_fail,
    )
    measured = asyncio.run(_run(args))
    base, red = measured["baseline"], measured["redundant"]
    result: dict[str, Any] = {
        "bench": "env-service",
        "baseline": args.baseline,
        "redundant": args.redundant,
        "baseline_batch_s": base["batch_s"],
        "redundant_batch_s": red["batch_s"],
        "speedup": base["batch_s"] / red["batch_s"],
        "baseline_reset_success": base["reset"]["success_rate"],
        "baseline_step_success": base["step"]["success_rate"],
        "redundant_reset_success": red["reset"]["success_rate"],
        "redundant_step_success": red["step"]["success_rate"],
        "baseline_reset_p50_ms": base["reset"]["p50_ms"],
        "baseline_reset_p99_ms": base["reset"]["p99_ms"],
        "baseline_step_p50_ms": base["step"]["p50_ms"],
        "baseline_step_p99_ms": base["step"]["p99_ms"],
        "answers_dropped": measured["answers_dropped"],
        "detail": {"baseline": base, "redundant": red},
        "model": {
            k: getattr(args, k)
            for k in ("mean", "std", "p_reset_fail", "p_slow", "slow_factor", "p_step_fail", "p_drop", "call_timeout")
        },
        "paper_figure": "RollArt paper Fig. 3: failing iterations 513 s vs 366 s, env.reset 78% of rollout time",
    }
    return write_report(
        args.out,
        "env-service",
        result,
        {args.baseline: base["batch_s"], args.redundant: red["batch_s"]},
        "seconds per batch",
        f"env service under failures: redundant groups {result['speedup']:.2f}x",
    )
