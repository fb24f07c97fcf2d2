"""autopilot: a job that sizes its own rollout pool against the same job on each fixed size, on namespace
hosts — steady step time, device-seconds per trained sample, and what happens when a second job queues.

Hosts: ``head`` (the driver and the trainer's ``H800``) and ``b`` with ``--devices`` ``H20`` devices for
rollout. Both sides' device time is modelled, so the result does not depend on this machine's cores: the
simulated engine decodes ``--max-batch`` sequences per worker at ``--decode-s`` seconds a token, so a
batch of ``4 x 4`` trajectories takes fewer rounds on more workers; the trainer's step takes ``--train-s``
seconds more than the tiny model's own (a device-bound trainer; rollout goes on meanwhile, ``alpha`` 1).

1. The sweep: the job on each fixed rollout size ``1..--devices`` (``--steps`` steps each); its steady
   step time is the median of the second half of its steps.
2. The autopilot: the job starts at one device of an elastic pool of at most ``--devices``
   (``elastic.autoscale``). After step ``--queue-at`` a second job (trainer on a CPU, rollout asking
   ``--devices - 1`` H20 devices) is started through the admission queue (as ``rollart submit`` does):
   it waits for the H20 devices the first job holds; the autopilot yields them and the second job starts.

``--json`` prints ``best_fixed_step_s``, ``autopilot_step_s`` (median over the steady phase: from the
first step after which the pool's size and target held, to the queued job), ``steps_to_steady``,
``device_s_per_sample`` (the autopilot's steady phase) and ``device_s_per_sample_largest`` (the largest
fixed size), ``yield_s`` (the autopilot's yield → the queued job admitted), ``queued_job_started``, the
autopilot run's ``ledger`` and the sweep's step times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NUM_GROUPS, GROUP_SIZE = 4, 4


def config(
    out: Path,
    *,
    steps: int,
    devices: int,
    max_devices: int | None,
    decode_s: float,
    max_batch: int,
    max_new_tokens: int,
    train_cpu: bool = False,
    name: str = "autopilot",
) -> dict[str, Any]:
    """The job: rollout on ``devices`` H20 (elastic up to ``max_devices`` with the autopilot), train on the
    H800 (``train_cpu``: on a CPU, the queued second job)."""
    rollout: dict[str, Any] = {"hardware": "H20", "devices": devices}
    elastic: dict[str, Any] = {"poll_s": 0.5, "drain_timeout_s": 10.0}
    if max_devices is not None:
        rollout["max_devices"] = max_devices
        elastic["autoscale"] = {"window": 3, "cooldown_steps": 2}
    return {
        "name": name,
        "seed": 0,
        "pools": {
            "train": {"hardware": "CPU", "cpus": 1} if train_cpu else {"hardware": "H800", "devices": 1},
            "rollout": rollout,
        },
        "envs": [{"name": "reverse", "groups": 2 * NUM_GROUPS, "kwargs": {"length": 3}}],
        "rollout": {
            "num_env_groups": 2 * NUM_GROUPS,
            "group_size": GROUP_SIZE,
            "batch_groups": NUM_GROUPS,
            "alpha": 1,
        },
        "sampling": {"temperature": 1.0, "max_new_tokens": max_new_tokens, "seed": 0},
        "advantage": "grpo",
        # the modelled device: each decode step costs decode_s, a worker decodes max_batch sequences at once
        "engine": {
            "kind": "simulated",
            "options": {"decode_base_s": decode_s, "decode_per_seq_s": 0.0, "max_batch_size": max_batch},
        },
        "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
        "elastic": elastic,
        "steps": steps,
        "checkpoint_every": 0,
        "export": {"hf": False},
        "output_dir": str(out),
        "cluster": {"metadata_store": str(out / "meta.sqlite")},
    }


# ---------------------------------------------------------------------- the driver (head host)
def make_pipeline(cfg: Any, train_s: float, queue_at: int | None) -> Any:
    """The pipeline with ``train_s`` of modelled trainer time per step, asking for the second job after
    step ``queue_at``."""
    from rollart.pipelines.agentic import AgenticPipeline

    class ModelledTrainer(AgenticPipeline):
        async def on_batch(self, step: int, groups: list[Any]) -> None:
            await asyncio.sleep(train_s)  # the trainer's device is busy; rollout goes on meanwhile

        async def on_step_end(self, step: int, record: dict[str, Any], trajs: list[Any]) -> None:
            if queue_at is not None and step == queue_at:
                print("NEED second_job", flush=True)  # the outer side starts it; the run goes on meanwhile

    return ModelledTrainer(cfg, progress=False)


def driver_main(argv: list[str]) -> int:
    from rollart.config import PipelineConfig

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True, help="the job's config as JSON")
    p.add_argument("--train-s", type=float, default=0.0)
    p.add_argument("--queue-at", type=int, default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("rollart.rollout.elastic").setLevel(logging.INFO)
    cfg = PipelineConfig.model_validate(json.loads(Path(a.config).read_text()))
    record: dict[str, Any] = {}
    pipe = make_pipeline(cfg, a.train_s, a.queue_at)
    try:
        row = pipe.rm.store.registry.jobs(pipe.rm.job_id) if pipe.rm.store.registry is not None else []
        record["admitted_at"] = (row[0].get("admitted_at") if row else None) or time.time()
        record["job_id"] = pipe.rm.job_id
        try:
            record["steps"] = len(pipe.run())
        except Exception as err:
            log.exception("the run failed")
            record["error"] = f"{type(err).__name__}: {err}"
        if pipe.elastic is not None:
            record["events"] = list(pipe.elastic.events)
    finally:
        pipe.shutdown()
    print("RESULT " + json.dumps(record, default=str), flush=True)
    return 1 if "error" in record else 0


# ---------------------------------------------------------------------- the outer side
def _start(hosts: Any, out: Path, cfg: dict[str, Any], train_s: float, queue_at: int | None, env: dict[str, str]):
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    args = [sys.executable, "-m", "rollart.benchmarks.autopilot", "--driver", "--config", str(out / "config.json")]
    args += ["--train-s", str(train_s)] + (["--queue-at", str(queue_at)] if queue_at is not None else [])
    log_file = (out / "driver.log").open("w")
    proc = hosts.popen("head", args, stdout=subprocess.PIPE, stderr=log_file, text=True, env=env)
    return proc, log_file


def _finish(proc: Any, out: Path, lines: list[str], timeout_s: float) -> dict[str, Any]:
    proc.wait(timeout=timeout_s)
    result = next((json.loads(x[len("RESULT ") :]) for x in lines if x.startswith("RESULT ")), None)
    if result is None or proc.returncode != 0:
        tail = (out / "driver.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"the driver in {out} failed (exit {proc.returncode}):\n{tail}")
    result["metrics"] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    result["ledger"] = json.loads((out / "ledger.json").read_text())
    return result


def run_job(hosts: Any, out: Path, cfg: dict[str, Any], train_s: float, timeout_s: float = 1200) -> dict[str, Any]:
    proc, log_file = _start(hosts, out, cfg, train_s, None, {})
    with log_file:
        assert proc.stdout is not None
        lines = list(proc.stdout)
    return _finish(proc, out, lines, timeout_s)


def run_autopilot(
    hosts: Any, out: Path, cfg: dict[str, Any], second: dict[str, Any], train_s: float, queue_at: int
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The autopilot job; the second job started through the admission queue when it asks."""
    from rollart.resource_manager.admission import Admission

    proc, log_file = _start(hosts, out / "autopilot", cfg, train_s, queue_at, {})
    second_run: dict[str, Any] = {}

    def start_second() -> None:
        env = Admission(submitted_at=time.time()).env()
        p2, f2 = _start(hosts, out / "second", second, 0.0, None, env)
        with f2:
            assert p2.stdout is not None
            lines2 = list(p2.stdout)
        try:
            second_run.update(_finish(p2, out / "second", lines2, 1200))
        except RuntimeError as err:
            second_run["error"] = str(err)

    thread: threading.Thread | None = None
    with log_file:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("NEED second_job") and thread is None:
                thread = threading.Thread(target=start_second, daemon=True)
                thread.start()
    result = _finish(proc, out / "autopilot", lines, 1200)
    if thread is not None:
        thread.join(timeout=1200)
    return result, (second_run or None)


# ---------------------------------------------------------------------- measures
def steady_step_s(metrics: list[dict[str, Any]]) -> float:
    half = metrics[len(metrics) // 2 :]
    return statistics.median(m["time"]["step_s"] for m in half)


def steady_phase(metrics: list[dict[str, Any]], until: int) -> tuple[int, list[dict[str, Any]]]:
    """The first step from which, up to step ``until``, the pool served its target size and no decision was
    taken; the records of that phase."""
    before = [m for m in metrics if m["step"] <= until]
    start = before[-1]["step"]
    for m in reversed(before):
        e = m["elastic"]
        if e["autopilot"] is not None or e["serving_devices"] != e["target"]:
            break
        start = m["step"]
    return start, [m for m in before if m["step"] >= start]


def summarise(sweep: dict[int, dict[str, Any]], auto: dict[str, Any], second: dict[str, Any] | None, queue_at: int):
    fixed = {n: steady_step_s(r["metrics"]) for n, r in sweep.items()}
    largest = max(sweep)
    steady_from, phase = steady_phase(auto["metrics"], queue_at)
    per_sample = statistics.median(m["cost"]["device_s_per_sample"] for m in phase)
    per_sample_largest = statistics.median(
        m["cost"]["device_s_per_sample"] for m in sweep[largest]["metrics"][len(sweep[largest]["metrics"]) // 2 :]
    )
    decisions = [e for e in auto.get("events", []) if e["event"] == "autopilot"]
    yielded = next((e for e in decisions if e["reason"] == "yield"), None)
    started = bool(second and not second.get("error") and second.get("metrics"))
    out: dict[str, Any] = {
        "fixed_step_s": {str(n): round(s, 3) for n, s in sorted(fixed.items())},
        "best_fixed_step_s": round(min(fixed.values()), 3),
        "best_fixed_devices": min(fixed, key=lambda n: fixed[n]),
        "autopilot_step_s": round(statistics.median(m["time"]["step_s"] for m in phase), 3),
        "autopilot_devices": phase[-1]["elastic"]["target"],
        "steps_to_steady": steady_from,
        "steady_steps": len(phase),
        "device_s_per_sample": round(per_sample, 4),
        "device_s_per_sample_largest": round(per_sample_largest, 4),
        "decisions": [
            {k: e[k] for k in ("step", "reason", "previous", "target")} | {"time": e["time"]} for e in decisions
        ],
        "queued_job_started": started,
        "yield_s": round(second["admitted_at"] - yielded["time"], 2) if started and yielded and second else None,
        "ledger": {k: auto["ledger"][k] for k in ("lost", "trained_twice", "rewards_invented")},
    }
    out["step_s_ratio_to_best_fixed"] = round(out["autopilot_step_s"] / out["best_fixed_step_s"], 3)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=4, help="H20 devices of the rollout host (the largest size)")
    p.add_argument("--steps", type=int, default=12, help="steps of each fixed-size run")
    p.add_argument("--autopilot-steps", type=int, default=30)
    p.add_argument("--queue-at", type=int, default=22, help="the second job queues after this step")
    p.add_argument("--train-s", type=float, default=0.8, help="modelled trainer time per step (s)")
    p.add_argument("--decode-s", type=float, default=0.02, help="modelled time of one decode step (s)")
    p.add_argument("--max-batch", type=int, default=4, help="sequences one worker decodes at once")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", default="runs/bench/autopilot")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart.testing import HostSpec, skip_reason, start_hosts

    reason = skip_reason()
    if reason:
        raise SystemExit(f"rollart bench autopilot needs namespace hosts: {reason}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    shape = {"decode_s": args.decode_s, "max_batch": args.max_batch, "max_new_tokens": args.max_new_tokens}
    specs = [HostSpec("head", {"H800": 1}, num_cpus=3), HostSpec("b", {"H20": args.devices}, num_cpus=2)]
    with start_hosts(specs, start_timeout_s=300) as hosts:
        sweep = {}
        for n in range(1, args.devices + 1):
            cfg = config(out / f"fixed-{n}", steps=args.steps, devices=n, max_devices=None, **shape)
            sweep[n] = run_job(hosts, out / f"fixed-{n}", cfg, args.train_s)
            log.info("fixed %d: steady step %.3f s", n, steady_step_s(sweep[n]["metrics"]))
        auto_cfg = config(out / "autopilot", steps=args.autopilot_steps, devices=1, max_devices=args.devices, **shape)
        second_cfg = config(
            out / "second", steps=3, devices=args.devices - 1, max_devices=None, train_cpu=True, name="second", **shape
        )
        auto, second = run_autopilot(hosts, out, auto_cfg, second_cfg, args.train_s, args.queue_at)
    result = {
        "bench": "autopilot",
        "engine": "simulated (modelled decode time)",
        "train_s_modelled": args.train_s,
        **summarise(sweep, auto, second, args.queue_at),
    }
    (out / "autopilot.json").write_text(json.dumps({**result, "autopilot_run": auto, "second": second}, default=str))
    result["files"] = [str(out / "autopilot.json")]
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--driver":
        sys.exit(driver_main(sys.argv[2:]))
