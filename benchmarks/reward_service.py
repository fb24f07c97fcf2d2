"""reward-service: the reward service's own cost (requests/s, latency) next to an in-process call.

Requests/s and p50/p99 latency at client concurrency 1, 16, 64 against a real
``rollart serve rewards`` process on 127.0.0.1 (one trajectory per request, ``exact_match``), next to
calling the same function in-process.

Sharing one service across jobs (seed 004 §7.5) is ``rollart bench shared-reward``: three real jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from rollart.benchmarks.common import add_common_arguments, write_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=300, help="requests per concurrency level (part 1)")
    add_common_arguments(p, "runs/bench/reward-service", time_scale=0.01)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(functions: list[str], extra: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollart.cli",
            "serve",
            "rewards",
            *functions,
            "--port",
            str(port),
            "--max-concurrency",
            "1024",
            *(extra or []),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=dict(os.environ),
    )
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError("reward server did not start")


async def _load(url: str, concurrency: int, n: int) -> dict[str, float]:
    lat: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    body = {"trajectories": [{"response": "42", "ground_truth": "42"}]}
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as http:

        async def one() -> None:
            async with sem:
                t0 = time.perf_counter()
                r = await http.post(url, json=body)
                r.raise_for_status()
                lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {
        "requests_per_s": n / wall,
        "p50_ms": 1000 * statistics.median(lat),
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    }


def _in_process(n: int) -> dict[str, float]:
    from rollart.reward.builtin import exact_match

    t0 = time.perf_counter()
    lat = []
    for _ in range(n):
        s = time.perf_counter()
        exact_match({"response": "42", "ground_truth": "42"})
        lat.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    lat.sort()
    return {"requests_per_s": n / wall, "p50_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * lat[int(0.99 * n)]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    proc, url = _serve(["rollart.reward.builtin:exact_match"])
    try:
        service = {c: asyncio.run(_load(url + "/rewards/exact_match", c, args.requests)) for c in (1, 16, 64)}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    local = _in_process(args.requests)
    result = {
        "bench": "reward-service",
        "service": {str(c): v for c, v in service.items()},
        "in_process": local,
        "see_also": "rollart bench shared-reward (three jobs sharing one service, seed 004 §7.5)",
    }
    return write_report(
        args.out,
        "reward-service",
        result,
        {f"c={c}": v["requests_per_s"] for c, v in service.items()},
        "requests/s",
        "reward service throughput by client concurrency",
    )
