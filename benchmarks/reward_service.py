"""reward-service: the reward service's own cost, and sharing one service across jobs (seed 004 §7.5).

Part 1 — requests/s and p50/p99 latency at client concurrency 1, 16, 64 against a real
``rollart serve rewards`` process on 127.0.0.1 (one trajectory per request, ``exact_match``), next to
calling the same function in-process.

Part 2 — three jobs, time-scaled. Each job has ``devices`` devices besides training. Dedicated: it
reserves ``reward_devices`` of them for its own reward worker and rolls out on the rest. Shared: the
three jobs send rewards to one service whose devices are pooled (``shared_devices``), and each job rolls
out on all of its devices. Rollout of a step is ``work / rollout devices``; trajectories finish evenly
over it and each reward takes ``reward_s`` on one reward device. Reported per mode: the mean rollout
time per step (until the last reward is back) and the reward devices' utilisation (busy / provisioned).
The rewards go through the real server and RewardClient; a semaphore in the reward function stands
for the reward devices.
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
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--batch", type=int, default=84, help="trajectories per step per job")
    p.add_argument("--devices", type=int, default=8, help="non-training devices per job")
    p.add_argument("--reward-devices", type=int, default=4, help="devices a job reserves for rewards (dedicated)")
    p.add_argument("--shared-devices", type=int, default=4, help="devices of the shared reward service")
    p.add_argument("--work", type=float, default=600.0, help="rollout device-seconds per step")
    p.add_argument("--reward-s", type=float, default=1.0, help="device-seconds per reward")
    p.add_argument("--steps", type=int, default=2)
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


async def _jobs(args: argparse.Namespace, shared: bool) -> dict[str, float]:
    """Run the jobs against reward servers (one shared, or one per job); returns means."""
    from rollart.cluster.serverless import RetryPolicy
    from rollart.reward.client import RewardClient

    scale = args.time_scale
    n_servers = 1 if shared else args.jobs
    devices_per_server = args.shared_devices if shared else args.reward_devices
    procs = [_serve(["rollart.reward.builtin:exact_match"]) for _ in range(n_servers)]
    # the reward "devices": a semaphore per server, held for reward_s of simulated time per trajectory
    gates = [asyncio.Semaphore(devices_per_server) for _ in range(n_servers)]
    busy = [0.0] * n_servers
    t_start = time.monotonic()

    async def reward(server: int, client: RewardClient) -> None:
        async with gates[server]:
            t0 = time.monotonic()
            await asyncio.sleep(args.reward_s * scale)
            score = await client.score({"response": "42", "ground_truth": "42"})
            busy[server] += time.monotonic() - t0
            assert score == 1.0

    async def job(j: int) -> list[float]:
        server = 0 if shared else j
        client = RewardClient(
            procs[server][1] + "/rewards/exact_match",
            max_batch=8,
            max_wait_ms=1,
            retry=RetryPolicy(retries=5, backoff_base_s=0.01),
            tenant=f"job{j}",
        )
        rollout_devices = args.devices - (0 if shared else args.reward_devices)
        step_rollout = args.work / rollout_devices
        times = []
        for _ in range(args.steps):
            t0 = time.monotonic()
            pending = []
            for _ in range(args.batch):  # trajectories finish evenly over the rollout
                await asyncio.sleep(step_rollout / args.batch * scale)
                pending.append(asyncio.ensure_future(reward(server, client)))
            await asyncio.gather(*pending)
            times.append((time.monotonic() - t0) / scale)
        await client.aclose()
        return times

    try:
        per_job = await asyncio.gather(*(job(j) for j in range(args.jobs)))
    finally:
        for proc, _ in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.monotonic() - t_start
    provisioned = n_servers * devices_per_server * wall
    return {
        "rollout_s": statistics.mean(t for times in per_job for t in times),
        "reward_utilisation": sum(busy) / provisioned,
        "reward_devices": n_servers * devices_per_server,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    proc, url = _serve(["rollart.reward.builtin:exact_match"])
    try:
        service = {c: asyncio.run(_load(url + "/rewards/exact_match", c, args.requests)) for c in (1, 16, 64)}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    local = _in_process(args.requests)
    dedicated = asyncio.run(_jobs(args, shared=False))
    shared = asyncio.run(_jobs(args, shared=True))
    result = {
        "bench": "reward-service",
        "service": {str(c): v for c, v in service.items()},
        "in_process": local,
        "dedicated": dedicated,
        "shared": shared,
        "rollout_speedup": dedicated["rollout_s"] / shared["rollout_s"],
        "seed_figure": "utilisation 6% -> 88%, rollout 158 s -> 77 s (seed 004 §7.5)",
    }
    return write_report(
        args.out,
        "reward-service",
        result,
        {"dedicated rollout": dedicated["rollout_s"], "shared rollout": shared["rollout_s"]},
        "rollout time per step (simulated s)",
        f"reward as a service: utilisation {dedicated['reward_utilisation']:.0%} -> {shared['reward_utilisation']:.0%}",
    )
