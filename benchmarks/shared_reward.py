"""shared-reward: three real jobs sharing one reward service vs each job with a dedicated one (RollArt paper §7.5).

Every job is a driver process running the real pipeline (:class:`~rollart.pipelines.agentic.AgenticPipeline`:
tiny model, torch trainer, inference workers on the simulated engine) against one Ray cluster: the
jobs run at the same time as three drivers inside the head host of a one-host namespace cluster
(:mod:`rollart.testing.hosts`, needs root), so they share one Ray, one machine and nothing else. Each
job scores its trajectories through ``rollart serve rewards`` as its own tenant (a token per tenant,
``--tenants``); the reward function is a verifier with a fixed cost (``--reward-ms`` per trajectory,
sleep-based: a stand-in for a reward model on an accelerator), and the service computes at most
``--slots`` trajectories at once (its devices).

The same hardware in both modes: each job owns ``--devices`` logical devices besides training.
Dedicated: a job keeps ``--reward-devices`` of them for its own reward service (``slots`` = those) and
generates on the rest. Shared: the jobs give ``--shared-devices`` devices in all to one service and
split the remaining ones evenly for generation. A device generates ``--seqs-per-device`` sequences at
once (the simulated engine's batch), so fewer rollout devices mean more decode waves per step.

Reported per mode: the reward service's utilisation, from its own ``/metrics``
(``rollart_reward_compute_seconds`` over ``slots`` × the jobs' wall time), and the mean rollout time
per step (``rollout_wait_s`` of the synchronous pipeline: generation plus the rewards of the step).
Every job's own count of scored trajectories is checked against the service's per-tenant metric.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollart.benchmarks.common import write_report

log = logging.getLogger("rollart.bench")
REWARD_MS_ENV = "ROLLART_BENCH_REWARD_MS"
MODULE = "rollart.benchmarks.shared_reward"  # also when run as __main__ (a driver)
PAPER_FIGURE = {"utilisation": "6% -> 88%", "rollout_s": "158 s -> 77 s", "source": "RollArt paper §7.5, Figure 14"}


async def verifier(trajectory: dict[str, Any]) -> float:
    """The bench's reward: an exact-match verdict after a fixed cost of ``$ROLLART_BENCH_REWARD_MS``."""
    import asyncio

    await asyncio.sleep(float(os.environ.get(REWARD_MS_ENV, "100")) / 1000.0)
    return float(str(trajectory.get("response", "")).strip() == str(trajectory.get("ground_truth", "")).strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="training steps per job (the first is not timed)")
    p.add_argument("--devices", type=int, default=4, help="non-training devices per job")
    p.add_argument("--reward-devices", type=int, default=2, help="devices a job keeps for its own service")
    p.add_argument("--shared-devices", type=int, default=3, help="devices of the shared service (in all)")
    p.add_argument("--seqs-per-device", type=int, default=4, help="sequences one rollout device decodes at once")
    p.add_argument("--groups", type=int, default=6, help="env groups per step per job")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48, help="tokens per response")
    p.add_argument("--decode-step", type=float, default=0.02, help="seconds per decode step")
    p.add_argument("--reward-ms", type=float, default=50.0, help="verifier cost per trajectory")
    p.add_argument("--modes", default="dedicated,shared")
    p.add_argument("--out", default="runs/bench/shared-reward")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per mode")


def _layout(args: argparse.Namespace, mode: str) -> tuple[int, int, int]:
    """``(services, slots per service, rollout devices per job)`` for ``mode``; same hardware in both."""
    if mode == "dedicated":
        if not 0 < args.reward_devices < args.devices:
            raise ValueError("--reward-devices: give 1 .. --devices - 1 (a job needs a rollout device)")
        return args.jobs, args.reward_devices, args.devices - args.reward_devices
    spare = args.jobs * args.devices - args.shared_devices
    if args.shared_devices < 1 or spare < args.jobs or spare % args.jobs:
        raise ValueError(
            f"--shared-devices {args.shared_devices}: jobs * devices - shared devices ({spare}) must split "
            f"evenly into >= 1 rollout device per job; e.g. --shared-devices {args.jobs * args.devices % args.jobs or args.jobs}"
        )
    return 1, args.shared_devices, spare // args.jobs


def _job_config(args: argparse.Namespace, tenant: str, rollout_devices: int, url: str, out: str) -> dict[str, Any]:
    return {
        "name": tenant,
        "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "H20", "devices": rollout_devices}},
        "envs": [{"name": "reverse", "groups": args.groups, "kwargs": {"length": 3}, "max_new_tokens": args.tokens}],
        "rollout": {"num_env_groups": args.groups, "group_size": args.group_size, "batch_groups": args.groups},
        "sampling": {"temperature": 1.0, "max_new_tokens": args.tokens},
        "engine": {
            "kind": "simulated",
            "options": {
                "decode_base_s": args.decode_step,
                "decode_per_seq_s": 0.0,
                "prefill_per_token_s": 0.0,
                "vocab_size": 60,
                "max_batch_size": args.seqs_per_device,
            },
        },
        "reward": {"url": url, "token_env": f"REWARD_TOKEN_{tenant.upper()}", "tenant": tenant, "retries": 5},
        "train": {"lr": 1e-4},
        "steps": args.steps,
        "checkpoint_every": 0,
        "export": {"hf": False},
        "output_dir": out,
    }


def _driver(config_json: str) -> None:
    """One job: run the pipeline, print ``RESULT {...}`` (rollout times, its reward counts, its window)."""
    from rollart.config import PipelineConfig
    from rollart.pipelines.agentic import AgenticPipeline

    pipe = AgenticPipeline(PipelineConfig.model_validate_json(config_json), progress=False)
    import asyncio

    t0 = time.time()
    try:
        history = asyncio.run(pipe._run())  # run() without its metrics.png: the bench times the jobs only
    finally:
        pipe.shutdown()
    assert pipe.rewards.client is not None
    result = {
        "rollout_s": [h["time"]["rollout_wait_s"] for h in history],
        "step_s": [h["time"]["step_s"] for h in history],
        "counts": pipe.rewards.client.counts(),
        "start": t0,
        "end": time.time(),
    }
    print("RESULT " + json.dumps(result), flush=True)


def _scrape(services: list[list[str]], wait_s: float) -> None:
    """Inside the head host: wait until every service (``[url, token variable]``) answers, print
    ``RESULT`` with their metrics (``/metrics`` of a service with tokens needs one)."""
    import os

    import httpx

    end = time.monotonic() + wait_s
    out = {}
    for url, token_env in services:
        while True:
            try:
                headers = {"Authorization": f"Bearer {os.environ[token_env]}"}
                out[url] = httpx.get(url + "/metrics", headers=headers, timeout=5).raise_for_status().text
                break
            except httpx.TransportError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)
    print("RESULT " + json.dumps(out), flush=True)


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def _run_mode(cluster: Any, args: argparse.Namespace, mode: str, workdir: Path) -> dict[str, Any]:
    import subprocess

    n_services, slots, rollout_devices = _layout(args, mode)
    tenants = [f"job{j}" for j in range(args.jobs)]
    tokens = {t: secrets.token_urlsafe(24) for t in tenants}
    env_tokens = {f"REWARD_TOKEN_{t.upper()}": tok for t, tok in tokens.items()}
    services: list[subprocess.Popen] = []
    urls = []
    try:
        for s in range(n_services):
            served = tenants if n_services == 1 else [tenants[s]]
            path = workdir / f"{mode}-tenants-{s}.yaml"
            path.write_text("tenants:\n" + "".join(f"  {t}: {{token_env: REWARD_TOKEN_{t.upper()}}}\n" for t in served))
            port = 8100 + s  # inside the run's own network namespace: no other process can hold it
            services.append(
                cluster.popen(
                    cluster.head,
                    [sys.executable, "-m", "rollart.cli", "serve", "rewards", f"verify={MODULE}:verifier"]
                    + ["--port", str(port), "--tenants", str(path), "--slots", str(slots), "--max-concurrency", "1024"],
                    env={**env_tokens, REWARD_MS_ENV: str(args.reward_ms)},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        readers = [[u, f"REWARD_TOKEN_{tenants[0 if n_services == 1 else s].upper()}"] for s, u in enumerate(urls)]
        scrape = [sys.executable, "-m", MODULE, "--scrape", json.dumps(readers)]
        cluster.run(cluster.head, scrape, env=env_tokens, timeout=120).check()  # every service is up
        drivers = []
        for j, tenant in enumerate(tenants):
            url = urls[0 if n_services == 1 else j] + "/rewards/verify"
            cfg = _job_config(args, tenant, rollout_devices, url, str(workdir / mode / tenant))
            env = {f"REWARD_TOKEN_{tenant.upper()}": tokens[tenant]}  # a job knows its own token only
            drivers.append(
                cluster.popen(
                    cluster.head,
                    [sys.executable, "-m", MODULE, "--driver", json.dumps(cfg)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        results = []
        deadline = time.monotonic() + args.timeout_s
        for proc in drivers:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"a {mode} job failed (rc {proc.returncode}):\n{out[-3000:]}\n{err[-5000:]}")
            results.append(json.loads(lines[-1][len("RESULT ") :]))
        scraped = cluster.run(cluster.head, scrape, env=env_tokens, timeout=120).check().result
        assert isinstance(scraped, dict)
    finally:
        for proc in services:
            proc.terminate()
            proc.wait(timeout=30)
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    busy = sum(_metric(text, "rollart_reward_compute_seconds_total") for text in scraped.values())
    per_tenant = {}
    for j, (tenant, r) in enumerate(zip(tenants, results, strict=True)):
        text = scraped[urls[0 if n_services == 1 else j]]
        per_tenant[tenant] = {
            "job_trajectories": r["counts"]["trajectories"],
            "job_requests": r["counts"]["requests"],
            "job_failed": r["counts"]["failed"],
            "service_trajectories": _metric(text, "rollart_reward_trajectories_total", tenant=tenant),
            "service_requests_200": _metric(text, "rollart_reward_requests_total", tenant=tenant, status="200"),
            "service_429": _metric(text, "rollart_reward_requests_total", tenant=tenant, status="429"),
        }
    timed = [t for r in results for t in (r["rollout_s"][1:] or r["rollout_s"])]  # step 0 warms up
    return {
        "reward_services": n_services,
        "slots_per_service": slots,
        "reward_devices": n_services * slots,
        "rollout_devices_per_job": rollout_devices,
        "devices_in_all": n_services * slots + args.jobs * rollout_devices,
        "wall_s": wall,
        "busy_s": busy,
        "utilisation": busy / (n_services * slots * wall),
        "rollout_s": statistics.mean(timed),
        "step_s": statistics.mean(t for r in results for t in (r["step_s"][1:] or r["step_s"])),
        "tenants": per_tenant,
        "counts_match": all(v["job_trajectories"] == v["service_trajectories"] for v in per_tenant.values()),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart.testing.hosts import HostSpec, skip_reason, start_hosts

    reason = skip_reason()
    if reason is not None:
        raise RuntimeError(f"rollart bench shared-reward runs the jobs on a namespace host: {reason}")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"dedicated", "shared"}:
        raise ValueError("--modes: give dedicated, shared or both (comma-separated)")
    for mode in modes:
        _layout(args, mode)  # a bad layout fails before anything starts
    devices = args.jobs * args.devices
    measured: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="rollart-shared-reward-") as tmp:
        spec = HostSpec("head", {"H20": devices}, num_cpus=args.jobs * (args.devices + 1) + 1, object_store_mb=256)
        with start_hosts([spec]) as cluster:
            for mode in modes:
                t0 = time.monotonic()
                measured[mode] = _run_mode(cluster, args, mode, Path(tmp))
                log.info("shared-reward %s: %.0f s", mode, time.monotonic() - t0)
    result: dict[str, Any] = {"bench": "shared-reward"}
    for mode, m in measured.items():
        result[f"{mode}_utilisation"] = m["utilisation"]
        result[f"{mode}_rollout_s"] = m["rollout_s"]
    if {"dedicated", "shared"} <= set(measured):
        result["rollout_speedup"] = measured["dedicated"]["rollout_s"] / measured["shared"]["rollout_s"]
    result["seed_utilisation"] = PAPER_FIGURE["utilisation"]
    result["seed_rollout"] = PAPER_FIGURE["rollout_s"]
    result["counts_match"] = all(m["counts_match"] for m in measured.values())
    result["setup"] = (
        f"{args.jobs} driver processes on one Ray cluster (one namespace host), {devices} logical devices; "
        f"verifier {args.reward_ms:.0f} ms per trajectory"
    )
    result["modes"] = measured
    result["paper_figure"] = PAPER_FIGURE
    bars = {f"{mode} rollout": m["rollout_s"] for mode, m in measured.items()}
    title = "shared reward service: utilisation " + " -> ".join(f"{m['utilisation']:.0%}" for m in measured.values())
    return write_report(args.out, "shared-reward", result, bars, "rollout time per step (s)", title)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="internal entry points of the shared-reward bench")
    p.add_argument("--driver", help="a job's pipeline config as JSON")
    p.add_argument("--scrape", help="JSON list of [service URL, variable holding a token of it]")
    p.add_argument("--wait-s", type=float, default=90.0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if a.driver:
        _driver(a.driver)
    elif a.scrape:
        _scrape(json.loads(a.scrape), a.wait_s)
    else:
        p.error("give --driver or --scrape")


if __name__ == "__main__":
    main()
