"""reward-service: the reward service's own cost (requests/s, latency) next to an in-process call.

``--part throughput`` (the default): requests/s and p50/p99 latency at client concurrency 1, 16, 64
against a real ``rollart serve rewards`` process on 127.0.0.1 (one trajectory per request,
``exact_match``), next to calling the same function in-process.

``--part slow-neighbours``: a stream of cheap requests (``math_answer``, one at a time, back to back)
against a server that also serves ``code_tests``, first alone, then while ``--slow`` (6) code requests
are computing (each a solution that spins until its ``--slow-s`` sandbox timeout, re-sent as soon as it
ends): p50/p99/max latency of the cheap requests in both phases. ``--compare-src DIR`` runs the same
measurement against the rollart source in ``DIR`` (e.g. ``git archive <rev> | tar -x -C DIR``) in the
same run, one server after the other, so two versions are compared on the same machine and load.

``--part tenants``: two tenants of one server (a token each, ``--tenants``) and one function,
``code_tests``. Tenant ``b`` sends cheap requests (one trajectory: a solution that prints its answer),
one at a time, back to back; first alone, then while tenant ``a`` floods the same function with
``--flood`` requests of ``--flood-trajectories`` slow trajectories each (a solution that sleeps
``--slow-s`` seconds, or spins with ``--flood-code spin``), re-sent as soon as each ends. Reported:
p50/p99/max latency of ``b``'s requests in both phases and how many of them were not scored 1.0.
``--compare-src DIR`` measures another version in the same run, as above.

Sharing one service across jobs (RollArt paper §7.5) is ``rollart bench shared-reward``: three real jobs.
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
    p.add_argument("--part", choices=["throughput", "slow-neighbours", "tenants"], default="throughput")
    p.add_argument("--requests", type=int, default=300, help="requests per concurrency level (throughput)")
    p.add_argument("--slow", type=int, default=6, help="slow code requests in flight (slow-neighbours)")
    p.add_argument("--slow-s", type=float, default=10.0, help="seconds each slow request computes")
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds of cheap requests per phase")
    p.add_argument("--compare-src", default=None, help="another rollart source folder, measured in the same run")
    p.add_argument("--flood", type=int, default=2, help="tenant a's requests in flight (tenants)")
    p.add_argument("--flood-trajectories", type=int, default=16, help="trajectories per flood request (tenants)")
    p.add_argument("--flood-code", choices=["sleep", "spin"], default="sleep", help="what a flood solution does")
    add_common_arguments(p, "runs/bench/reward-service", time_scale=0.01)


_OTHER_SOURCE = (
    "import runpy, sys\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in type(f).__name__ and "
    "'editable' not in getattr(f, '__name__', '')]\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "sys.argv = sys.argv[2:]\n"
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(
    functions: list[str], extra: list[str] | None = None, src: str | None = None
) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    # another version of rollart (``src``): imported from its folder, ahead of an editable install's finder
    python = [sys.executable, "-m"] if src is None else [sys.executable, "-c", _OTHER_SOURCE, src]
    proc = subprocess.Popen(
        [
            *python,
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


def _quantiles(lat: list[float]) -> dict[str, float]:
    lat = sorted(lat)
    if not lat:
        return {"requests": 0}
    return {
        "requests": len(lat),
        "p50_ms": 1000 * statistics.median(lat),
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "max_ms": 1000 * lat[-1],
    }


SPIN = "while True:\n    pass\n"


async def _cheap_stream(http: httpx.AsyncClient, url: str, seconds: float) -> list[float]:
    body = {"trajectories": [{"response": "so \\boxed{4}", "ground_truth": "4"}]}
    lat: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        r = await http.post(url + "/rewards/math_answer", json=body)
        r.raise_for_status()
        lat.append(time.perf_counter() - t0)
    return lat


async def _neighbours(url: str, slow: int, slow_s: float, phase_s: float) -> dict[str, Any]:
    code = {"trajectories": [{"response": SPIN, "ground_truth": {"tests": [{"input": "", "output": "x"}],
                                                                  "timeout_s": slow_s}}]}  # fmt: skip
    statuses: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=slow + 4)) as http:
        alone = await _cheap_stream(http, url, phase_s)
        stop = asyncio.Event()

        async def keep_busy() -> None:
            while not stop.is_set():
                r = await http.post(url + "/rewards/code_tests", json=code)
                statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1

        busy = [asyncio.ensure_future(keep_busy()) for _ in range(slow)]
        while (await http.get(url + "/healthz")).json()["in_flight"] < slow:
            await asyncio.sleep(0.05)
        loaded = await _cheap_stream(http, url, phase_s)
        stop.set()
        for t in busy:
            t.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
    return {"alone": _quantiles(alone), "with_slow": _quantiles(loaded), "slow_statuses": statuses}


def _slow_neighbours(args: argparse.Namespace) -> dict[str, Any]:
    functions = ["rollart.reward.builtin:code_tests", "rollart.reward.builtin:math_answer", "--timeout-s", "600"]
    versions: list[tuple[str, str | None, list[str]]] = []
    if args.compare_src:  # an older rollart: no --sandbox-* flags, the request's timeout_s is the limit
        versions.append(("compare", args.compare_src, []))
    versions.append(("this", None, ["--sandbox-timeout-s", str(args.slow_s)]))
    out: dict[str, Any] = {}
    for name, src, extra in versions:
        proc, url = _serve(functions + extra, src=src)
        try:
            out[name] = asyncio.run(_neighbours(url, args.slow, args.slow_s, args.phase_s))
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result = {
        "bench": "reward-service",
        "part": "slow-neighbours",
        "slow_requests": args.slow,
        "slow_s": args.slow_s,
        "phase_s": args.phase_s,
        "compare_src": args.compare_src,
        **out,
    }
    bars = {f"{n} {phase}": v[phase].get("p99_ms", 0.0) for n, v in out.items() for phase in ("alone", "with_slow")}
    return write_report(
        args.out,
        "reward-service-slow-neighbours",
        result,
        bars,
        "cheap request p99 (ms)",
        "cheap requests next to slow code",
    )


def _code(code: str, timeout_s: float) -> dict[str, Any]:
    return {"response": code, "ground_truth": {"tests": [{"input": "", "output": "x"}], "timeout_s": timeout_s}}


async def _two_tenants(url: str, tokens: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    wait = f"import time\ntime.sleep({args.slow_s:g})\nprint('x')\n"
    spin = f"import time\nend = time.time() + {args.slow_s:g}\nwhile time.time() < end:\n    pass\nprint('x')\n"
    slow = _code(wait if args.flood_code == "sleep" else spin, args.slow_s + 5)
    cheap = {"trajectories": [_code("print('x')", 10)]}
    heads = {t: {"Authorization": f"Bearer {tok}"} for t, tok in tokens.items()}
    statuses: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=args.flood + 4)) as http:

        async def stream(seconds: float) -> tuple[list[float], int]:
            lat, wrong = [], 0
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                r = await http.post(url + "/rewards/code_tests", json=cheap, headers=heads["b"])
                lat.append(time.perf_counter() - t0)
                wrong += r.status_code != 200 or r.json()["result"] != [1.0]
            return lat, wrong

        alone, wrong_alone = await stream(args.phase_s)
        stop = asyncio.Event()

        async def keep_flooding() -> None:
            body = {"trajectories": [slow] * args.flood_trajectories}
            while not stop.is_set():
                r = await http.post(url + "/rewards/code_tests", json=body, headers=heads["a"])
                statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1

        flood = [asyncio.ensure_future(keep_flooding()) for _ in range(args.flood)]
        while (await http.get(url + "/healthz")).json()["running"].get("code_tests", 0) < 2:
            await asyncio.sleep(0.05)
        flooded, wrong_flooded = await stream(args.phase_s)
        stop.set()
        for t in flood:
            t.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    return {
        "alone": {**_quantiles(alone), "not_1.0": wrong_alone},
        "flooded": {**_quantiles(flooded), "not_1.0": wrong_flooded},
        "flood_statuses": statuses,
    }


def _tenants(args: argparse.Namespace) -> dict[str, Any]:
    import secrets
    import tempfile

    tokens = {"a": secrets.token_urlsafe(24), "b": secrets.token_urlsafe(24)}
    os.environ.update({"BENCH_TENANT_A": tokens["a"], "BENCH_TENANT_B": tokens["b"]})
    folder = tempfile.mkdtemp(prefix="rollart-bench-tenants-")
    tenants = os.path.join(folder, "tenants.yaml")
    with open(tenants, "w") as f:
        f.write("tenants:\n  a: {token_env: BENCH_TENANT_A}\n  b: {token_env: BENCH_TENANT_B}\n")
    flags = ["rollart.reward.builtin:code_tests", "--tenants", tenants, "--timeout-s", "600",
             "--sandbox-timeout-s", str(args.slow_s + 5)]  # fmt: skip
    versions: list[tuple[str, str | None]] = [("compare", args.compare_src)] if args.compare_src else []
    versions.append(("this", None))
    out: dict[str, Any] = {}
    for name, src in versions:
        proc, url = _serve(flags, src=src)
        try:
            out[name] = asyncio.run(_two_tenants(url, tokens, args))
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result = {
        "bench": "reward-service",
        "part": "tenants",
        "flood": args.flood,
        "flood_trajectories": args.flood_trajectories,
        "flood_code": args.flood_code,
        "slow_s": args.slow_s,
        "phase_s": args.phase_s,
        "compare_src": args.compare_src,
        **out,
    }
    bars = {f"{n} {phase}": v[phase].get("p99_ms", 0.0) for n, v in out.items() for phase in ("alone", "flooded")}
    return write_report(
        args.out, "reward-service-tenants", result, bars, "tenant b's p99 (ms)", "a cheap tenant next to a flood"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.part == "slow-neighbours":
        return _slow_neighbours(args)
    if args.part == "tenants":
        return _tenants(args)
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
        "see_also": "rollart bench shared-reward (three jobs sharing one service, RollArt paper §7.5)",
    }
    return write_report(
        args.out,
        "reward-service",
        result,
        {f"c={c}": v["requests_per_s"] for c, v in service.items()},
        "requests/s",
        "reward service throughput by client concurrency",
    )
