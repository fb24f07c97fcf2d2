"""The OpenAI-compatible endpoint with the harness in processes of its own, as real harnesses run.

``rollart bench agent-endpoint [--concurrency 8,64,256] [--turns 4] [--max-tokens 16]
[--harness-processes 4] [--processes 1]``. At each concurrency ``c``, ``c`` sessions each make
``--turns`` chat calls in a row (each sends the history so far) with the official ``openai`` client
(``AsyncOpenAI``) in ``--harness-processes`` processes (:mod:`rollart.benchmarks.agent_harness`),
against, in turn:

- ``stub``: a server that answers every call at once: the harness's own limit on this machine;
- ``in_driver``: the endpoint in the driver's event loop (``serving.processes: 0``);
- ``processes``: the endpoint in ``--processes`` server processes beside the driver (the default);
- ``direct``: the same token counts as direct ``LLMProxy.generate`` calls from the driver (no HTTP);
- ``agent_env_driver`` / ``agent_env``: ``c`` episodes of the ``agent`` env kind (its env manager, a
  session each, the same calls) with the harness in the driver's event loop, then in
  ``--harness-processes`` harness processes (``serving.harness_processes``), the endpoint in processes.

The engine is the simulated one on one inference worker (``--decode-s`` per step). Per mode: calls/s,
p50/p99 latency, and CPU per call of the driver process (what the job's driver pays per agent call), of
the endpoint's server processes and of the harness processes; the modes take turns ``--repeat`` times
and each figure is the median of its runs. Writes ``agent_endpoint.json`` and a chart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart.benchmarks.common import start_inference, write_report

log = logging.getLogger("rollart.bench")
QUESTION = "Ann has 12 apples and gets 7 more. How many now?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="8,64,256", help="concurrent sessions, comma-separated")
    p.add_argument("--turns", type=int, default=4, help="calls per session (each sends the history so far)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per call")
    p.add_argument("--decode-s", type=float, default=0.002, help="simulated engine: seconds per decode step")
    p.add_argument("--harness-processes", type=int, default=4, help="processes the openai-client harness runs in")
    p.add_argument("--processes", type=int, default=1, help="the endpoint's server processes (serving.processes)")
    p.add_argument(
        "--modes",
        default="stub,in_driver,processes,direct,agent_env_driver,agent_env",
        help="what to measure, comma-separated",
    )
    p.add_argument("--repeat", type=int, default=3, help="runs of each mode per concurrency (medians reported)")
    p.add_argument("--out", default="bench_results", help="folder for the JSON and the chart")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def _threads() -> dict[str, float]:
    """CPU seconds of each of this process's threads, by name (the event loop's, Ray's own)."""
    import os

    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended meanwhile
            continue
        out[f"{name}:{tid}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each number the median of the runs' (the other fields the first run's), with the runs' calls/s."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        numbers = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        out[key] = statistics.median(numbers) if isinstance(value, (int, float)) and numbers else value
    out["rps_runs"] = [round(r["rps"], 1) for r in runs]
    return out


def _cpu_s(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


class Harnesses:
    """``n`` harness processes, given one job each at a time."""

    def __init__(self, n: int):
        self.n = n
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self) -> None:
        for _ in range(self.n):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "rollart.benchmarks.agent_harness",
                "harness",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            self.procs.append(proc)
        for proc in self.procs:
            assert proc.stdout is not None
            json.loads(await proc.stdout.readline())  # imported and ready

    async def play(self, urls: list[str], token: str, args: argparse.Namespace) -> dict[str, Any]:
        """Every session of ``urls`` played at once, spread over the processes: calls/s, latencies, CPU."""
        shares = [urls[i :: self.n] for i in range(self.n)]
        t0 = time.perf_counter()
        for proc, share in zip(self.procs, shares):
            job = {"urls": share, "token": token, "turns": args.turns, "max_tokens": args.max_tokens}
            assert proc.stdin is not None
            proc.stdin.write((json.dumps({**job, "question": QUESTION}) + "\n").encode())
        results = []
        for proc in self.procs:
            assert proc.stdout is not None
            results.append(json.loads(await proc.stdout.readline()))
        wall = time.perf_counter() - t0
        latencies = [x for r in results for x in r["latencies"]]
        failures = sum(r["failures"] for r in results)
        if failures:
            log.warning("agent-endpoint: %d session(s) failed, e.g. %s", failures, [r["failed"] for r in results])
        return {
            "calls": len(latencies),
            "failures": failures,
            "wall_s": wall,
            "rps": len(latencies) / wall,
            "p50_ms": 1e3 * statistics.median(latencies) if latencies else float("nan"),
            "p99_ms": 1e3 * _pct(latencies, 0.99),
            "harness_cpu_ms_per_call": 1e3 * sum(r["cpu_s"] for r in results) / max(1, len(latencies)),
        }

    async def stop(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.close()
            await proc.wait()


async def _stub() -> tuple[asyncio.subprocess.Process, int]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rollart.benchmarks.agent_harness",
        "stub",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    return proc, int(json.loads(await proc.stdout.readline())["port"])


async def _through(
    endpoint: Any,
    harness: Harnesses,
    c: int,
    args: argparse.Namespace,
    pids: list[int],
    workers: list[int],
    batcher: Any = None,
) -> dict:
    """``c`` sessions of ``endpoint`` played by the harness: the figures, with the CPU per call of the
    driver, of the endpoint processes (``pids``) and of the inference worker (``workers``), and the calls
    the closed sessions recorded; ``batcher``: the LLMProxy's, to count the requests per Ray call."""
    sessions = [await endpoint.open_session("agent") for _ in range(c)]
    urls = [endpoint.session_url(s) for s in sessions]
    b0 = (batcher.calls, batcher.requests) if batcher is not None else (0, 0)
    c0, e0, w0 = time.process_time(), _cpu_s(pids), _cpu_s(workers)
    t0 = _threads()
    row = await harness.play(urls, endpoint.token, args)
    t1 = _threads()
    diff = {k: round(1e3 * (v - t0.get(k, 0)) / max(1, row["calls"]), 3) for k, v in t1.items()}
    row["driver_threads_ms_per_call"] = dict(sorted(diff.items(), key=lambda x: -x[1])[:3])
    if batcher is not None:
        row["requests_per_ray_call"] = (batcher.requests - b0[1]) / max(1, batcher.calls - b0[0])
    driver_cpu, endpoint_cpu = time.process_time() - c0, _cpu_s(pids) - e0
    row["worker_cpu_ms_per_call"] = 1e3 * (_cpu_s(workers) - w0) / max(1, row["calls"])
    closed = [await endpoint.close_session(s, "done") for s in sessions]
    calls = max(1, row["calls"])
    row["recorded_calls"] = sum(len(s.calls) for s in closed if s is not None)
    row["driver_cpu_ms_per_call"] = 1e3 * driver_cpu / calls
    row["endpoint_cpu_ms_per_call"] = 1e3 * endpoint_cpu / calls if pids else None
    return row


MODES = ("stub", "in_driver", "processes", "direct", "agent_env_driver", "agent_env")


@dataclass
class Setup:
    """What every mode runs against: the LLMProxy over one simulated inference worker, the tokenizer, the
    sampling of every call, the first call's prompt tokens."""

    args: argparse.Namespace
    proxy: Any
    tok: Any
    sampling: Any
    first: list[int] = field(default_factory=list)
    workers: list[int] = field(default_factory=list)


async def _direct(setup: Setup, c: int) -> dict[str, Any]:
    """The same calls as direct LLMProxy calls from the driver."""
    from rollart.rollout.types import GenerateRequest

    args, tok = setup.args, setup.tok
    more = tok.encode("\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    lat: list[float] = []

    async def one(i: int) -> None:
        prompt = list(setup.first)
        for turn in range(args.turns):
            t0 = time.perf_counter()
            request = GenerateRequest(request_id=f"d{c}:{i}:{turn}", prompt_token_ids=prompt, sampling=setup.sampling)
            out = await setup.proxy.generate(request, "agent")
            lat.append(time.perf_counter() - t0)
            prompt = prompt + out.output_token_ids + more

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(i) for i in range(c)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "calls": len(lat),
        "rps": len(lat) / wall,
        "p50_ms": 1e3 * statistics.median(lat),
        "p99_ms": 1e3 * _pct(lat, 0.99),
        "driver_cpu_ms_per_call": 1e3 * cpu / len(lat),
    }


async def _agent_env(setup: Setup, c: int, endpoint: Any, pool: Any) -> dict[str, Any]:
    """``c`` episodes of the ``agent`` env kind at once, the harness in the driver or in ``pool``."""
    from rollart.benchmarks.agent_harness import episode
    from rollart.serving.agent import AgentEnvManager, AgentSpec

    args = setup.args
    spec = AgentSpec(agent="rollart.benchmarks.agent_harness:episode")
    task = {"turns": args.turns, "max_tokens": args.max_tokens, "question": QUESTION}
    managers = [
        AgentEnvManager(spec, endpoint, agent=episode, tasks=lambda seed: dict(task), harness=pool) for _ in range(c)
    ]
    pids = endpoint.pids() + (pool.pids() if pool is not None else [])
    t0, c0, e0 = time.perf_counter(), time.process_time(), _cpu_s(pids)
    trajs = await asyncio.gather(*(m.run(seed=i) for i, m in enumerate(managers)))
    wall, cpu, others = time.perf_counter() - t0, time.process_time() - c0, _cpu_s(pids) - e0
    calls = sum(t.info.get("calls", 0) for t in trajs)
    failed = [t.error for t in trajs if t.status != "ok"]
    if failed:
        log.warning("agent-endpoint: %d episode(s) failed, e.g. %s", len(failed), failed[:3])
    return {
        "calls": calls,
        "failures": len(failed),
        "rps": calls / wall,
        "driver_cpu_ms_per_call": 1e3 * cpu / max(1, calls),
        "endpoint_and_harness_cpu_ms_per_call": 1e3 * others / max(1, calls),
    }


async def _level(setup: Setup, c: int, modes: set[str], parts: dict[str, Any]) -> dict[str, Any]:
    """One concurrency: every mode ``--repeat`` times, taking turns (the machine's drift weighs on each)."""
    args, batcher = setup.args, setup.proxy.batcher
    harness, in_driver, processes, pool = parts["harness"], parts["in_driver"], parts["processes"], parts["pool"]
    urls = [f"http://127.0.0.1:{parts['stub_port']}/sessions/s{i}/v1" for i in range(c)]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES if m in modes}
    for _ in range(args.repeat):
        if "stub" in modes:
            runs["stub"].append(await harness.play(urls, "stub", args))
        if "in_driver" in modes:
            runs["in_driver"].append(await _through(in_driver, harness, c, args, [], setup.workers, batcher))
        if "processes" in modes:
            pids = processes.pids()
            runs["processes"].append(await _through(processes, harness, c, args, pids, setup.workers, batcher))
        if "direct" in modes:
            runs["direct"].append(await _direct(setup, c))
        if "agent_env_driver" in modes:
            runs["agent_env_driver"].append(await _agent_env(setup, c, processes, None))
        if "agent_env" in modes:
            runs["agent_env"].append(await _agent_env(setup, c, processes, pool))
    row: dict[str, Any] = {"concurrency": c, **{m: _median(r) for m, r in runs.items()}}
    if "stub" in row and "processes" in row:
        row["processes_vs_stub"] = row["processes"]["rps"] / row["stub"]["rps"]
    log.info("agent-endpoint %s", json.dumps(row))
    return row


async def _bench(setup: Setup, levels: list[int], modes: set[str]) -> list[dict[str, Any]]:
    """Start the stub, the harness processes, both endpoints and the harness pool; measure every level."""
    from rollart.serving.config import ServingConfig
    from rollart.serving.endpoint import PolicyEndpoint, build_service
    from rollart.serving.harness import HarnessPool
    from rollart.serving.processes import EndpointProcesses
    from rollart.serving.service import ProxyBackend

    args, proxy, tok = setup.args, setup.proxy, setup.tok
    config = ServingConfig(max_concurrency=4096, max_sessions=8192, processes=args.processes)
    service = build_service(ProxyBackend(proxy), tok, config, model="policy", sampling=setup.sampling)
    assert service.renderer is not None
    setup.first = service.renderer.prompt([{"role": "user", "content": QUESTION}])
    stub, stub_port = await _stub()
    parts: dict[str, Any] = {
        "stub_port": stub_port,
        "harness": Harnesses(args.harness_processes),
        "in_driver": PolicyEndpoint(service, config),
        "processes": EndpointProcesses(ProxyBackend(proxy), tok, config, model="policy", sampling=setup.sampling),
        "pool": HarnessPool(args.harness_processes),
    }
    try:
        await parts["harness"].start()
        await parts["in_driver"].start()
        await parts["processes"].start()
        if "agent_env" in modes:
            await parts["pool"].start()
            await _agent_env(setup, 2 * args.harness_processes, parts["processes"], parts["pool"])  # warm
        await _through(parts["processes"], parts["harness"], 8, args, [], [])  # warm: the first calls
        return [await _level(setup, c, modes, parts) for c in levels]
    finally:
        await parts["harness"].stop()
        await parts["pool"].stop()
        await parts["processes"].stop()
        await parts["in_driver"].stop()
        assert stub.stdin is not None
        stub.stdin.close()
        await stub.wait()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart.engines.base import SamplingParams
    from rollart.models.tiny import build_tokenizer, default_corpus
    from rollart.rollout.llm_proxy import LLMProxy

    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    modes = {m.strip() for m in str(args.modes).split(",") if m.strip()}
    if modes - set(MODES):
        raise SystemExit(f"--modes: unknown {sorted(modes - set(MODES))}; choose from {', '.join(MODES)}")
    for name in ("httpx", "httpx2"):  # the openai client logs every call at INFO: not part of what is measured
        logging.getLogger(name).setLevel(logging.WARNING)
    tok = build_tokenizer(default_corpus(400), Path(tempfile.mkdtemp(prefix="rollart-bench-tok-")), 320, chat=True)
    rm, cluster = start_inference(
        {"rollout": {"hardware": "H20", "devices": 1}},
        {"*": ["H20"]},
        {"decode_base_s": args.decode_s, "decode_per_seq_s": 0.0, "prefill_per_token_s": 0.0, "vocab_size": 60},
    )
    proxy = LLMProxy(cluster, batch_requests=True)
    sampling = SamplingParams(max_new_tokens=args.max_tokens, temperature=1.0)
    setup = Setup(args, proxy, tok, sampling, workers=list(cluster.pids().values()))
    try:
        rows = asyncio.run(_bench(setup, levels, modes))
    finally:
        proxy.close()
        cluster.shutdown()
        rm.shutdown()
    result: dict[str, Any] = {
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "decode_s": args.decode_s,
        "harness_processes": args.harness_processes,
        "processes": args.processes,
        "repeat": args.repeat,
        "rows": rows,
    }
    bars = {f"{mode} @{r['concurrency']}": r[mode]["rps"] for r in rows for mode in MODES if mode in r}
    return write_report(args.out, "agent_endpoint", result, bars, "calls/s", "agent calls/s by where the endpoint runs")
