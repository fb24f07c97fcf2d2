"""elastic: rollout capacity that joins and leaves a running job on namespace hosts — rollout tokens/s over
time as a host joins the Ray cluster mid-run, its inference workers start and serve, and the host is
drained and removed; with the join latency, throughput per phase and the trajectory ledger.

The run (:func:`driver_main`, inside the head host) is the agentic pipeline with an elastic rollout pool
(``{hardware: H20, devices: 1, max_devices: 1 + JOINING}``), rewards from a real ``rollart serve rewards``
process (:func:`rollart.benchmarks.chaos.letter_reward`). After step ``join_at`` the driver asks the outer
side (:func:`run_elastic`, which owns the hosts) to add a host with ``JOINING`` H20 devices and waits, while
rollout goes on, until the new workers serve; after step ``drain_at`` it asks for that host to be drained
(Ray's drain API, what an autoscaler or ``ray drain-node`` does) and waits until the workers left; the outer
side removes the host once Ray reports its node gone. A sampler records the tokens the LLMProxy returned and
the serving workers every ``sample_s``.

``rollart bench elastic`` runs it on the simulated engine (each decode step takes modelled device time, so
the throughput a worker adds does not depend on this machine's cores); the test
``tests/test_elastic_hosts.py`` runs it on the torch engine and compares the reward curve with a run on a
fixed pool.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("rollart.bench")

JOINING = 2  # H20 devices of the host that joins (one worker each)
NUM_GROUPS, GROUP_SIZE = 4, 4


def config(
    out: Path,
    *,
    steps: int,
    seed: int,
    reward_url: str,
    elastic: bool = True,
    engine: str = "torch",
    alpha: int = 0,
    channel: str = "ray",
    joining: int = JOINING,
    max_new_tokens: int = 1,
) -> Any:
    """The run's job: train on ``H800`` (head host), rollout on ``H20`` — one device at start, elastic up to
    ``1 + joining`` (``elastic=False``: the fixed pool of one device the curve is compared with)."""
    from rollart.config import PipelineConfig

    rollout: dict[str, Any] = {"hardware": "H20", "devices": 1}
    if elastic:
        rollout["max_devices"] = 1 + joining
    # the simulated engine models each decode step's device time, mostly per sequence (a device busy with its
    # batch): a worker that joins adds its own device's throughput, whatever this machine's cores do
    if engine == "simulated":
        engine_cfg: dict[str, Any] = {
            "kind": "simulated",
            "options": {"decode_base_s": 0.005, "decode_per_seq_s": 0.003, "vocab_size": 60},
        }
    else:
        engine_cfg = {"kind": "torch"}
    return PipelineConfig.model_validate(
        {
            "name": "elastic",
            "seed": seed,
            "pools": {"train": {"hardware": "H800", "devices": 1}, "rollout": rollout},
            "envs": [{"name": "reverse", "groups": NUM_GROUPS * (alpha + 1), "kwargs": {"length": max_new_tokens}}],
            "rollout": {
                "num_env_groups": NUM_GROUPS * (alpha + 1),
                "group_size": GROUP_SIZE,
                "batch_groups": NUM_GROUPS,
                "alpha": alpha,
            },
            "sampling": {"temperature": 1.0, "max_new_tokens": max_new_tokens, "seed": seed},
            "advantage": "grpo",
            "engine": engine_cfg,
            "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
            "train": {"lr": 0.02},
            "reward": {"url": reward_url, "retries": 4, "timeout_s": 10.0},
            "elastic": {"poll_s": 0.5, "drain_timeout_s": 30.0},
            "steps": steps,
            "checkpoint_every": 0,
            "weights": {"channel": channel},
            "export": {"hf": False},
            "output_dir": str(out),
            "cluster": {"metadata_store": str(out / "meta.sqlite")},
        }
    )


# ---------------------------------------------------------------------- the driver (head host)
def make_pipeline(
    cfg: Any,
    record: dict[str, Any],
    *,
    join_at: int,
    drain_at: int,
    joining: int,
    sample_s: float,
    lose_at: int | None = None,
) -> Any:
    """The pipeline with the join and drain asked for after steps ``join_at`` and ``drain_at`` (each waited
    for while rollout goes on), every trained reward recomputed, and a throughput sampler."""
    from rollart.benchmarks.chaos import count_reward_checks
    from rollart.pipelines.agentic import AgenticPipeline

    class ElasticRun(AgenticPipeline):
        sampler: asyncio.Task | None = None

        async def on_run_start(self) -> None:
            self.sampler = asyncio.ensure_future(self._sample())

        async def on_step_end(self, step: int, step_record: dict[str, Any], trajs: list[Any]) -> None:
            count_reward_checks(trajs, record)  # rewards invented: every trained reward recomputed
            if self.elastic is None:
                return
            if step == join_at:
                self._ask("add_host")
                await self._until(lambda: self.elastic.totals["joined"] >= joining, "the new workers serve")
            if step == lose_at:  # the host vanishes (every process killed), then comes back
                self._ask("kill_host")
                await self._until(lambda: self.elastic.totals["lost"] >= joining, "the lost workers left the pool")
                self._ask("restart_host")
                await self._until(lambda: self.elastic.totals["joined"] >= 2 * joining, "the pool grew back")
            if step == drain_at:
                self._ask("drain_host")
                await self._until(lambda: self.elastic.totals["left"] >= joining, "the drained workers left")

        def _ask(self, what: str) -> None:
            record["asked"][what] = time.monotonic() - record["t0"]
            print(f"NEED {what}", flush=True)  # the outer side does it; the run goes on meanwhile

        async def _until(self, done: Any, what: str, timeout_s: float = 600.0) -> None:
            start = time.monotonic()
            deadline = start + timeout_s
            while not done():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
                await asyncio.sleep(0.2)  # the rollout and the elastic thread make progress meanwhile
            # the step loop waited: rollout stops at the async bound then, so phases leave this time out
            record["waits"].append((start - record["t0"], time.monotonic() - record["t0"]))

        async def _sample(self) -> None:
            while True:
                tokens = sum(s["output_tokens"] for s in self.proxy.metrics().values())
                workers = sum(1 for p in self.infer.placement() if p["alive"] and not p["draining"])
                record["timeline"].append((round(time.monotonic() - record["t0"], 3), tokens, workers))
                await asyncio.sleep(sample_s)

    return ElasticRun(cfg, progress=False)


def driver_main(argv: list[str]) -> int:
    from rollart.benchmarks.chaos import RewardService, free_port

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fixed", action="store_true", help="a fixed pool: no host joins (the comparison run)")
    p.add_argument("--join-at", type=int, default=2)
    p.add_argument("--drain-at", type=int, default=7)
    p.add_argument("--lose-at", type=int, default=None, help="kill the joined host after this step, then restart it")
    p.add_argument("--joining", type=int, default=JOINING)
    p.add_argument("--engine", default="torch", choices=["torch", "simulated"])
    p.add_argument("--alpha", type=int, default=0)
    p.add_argument("--channel", default="ray", choices=["ray", "mooncake"])
    p.add_argument("--max-new-tokens", type=int, default=1)
    p.add_argument("--sample-s", type=float, default=0.5)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("rollart.rollout.elastic").setLevel(logging.INFO)
    out = Path(a.out)
    reward = RewardService(free_port()).start()
    record: dict[str, Any] = {"asked": {}, "timeline": [], "waits": [], "rewards_mismatch": 0, "unverifiable": 0}
    pipe = None
    try:
        record["t0"] = time.monotonic()
        cfg = config(
            out,
            steps=a.steps,
            seed=a.seed,
            reward_url=reward.url,
            elastic=not a.fixed,
            engine=a.engine,
            alpha=a.alpha,
            channel=a.channel,
            joining=a.joining,
            max_new_tokens=a.max_new_tokens,
        )
        pipe = make_pipeline(
            cfg,
            record,
            join_at=a.join_at,
            drain_at=a.drain_at,
            joining=a.joining,
            sample_s=a.sample_s,
            lose_at=a.lose_at,
        )
        try:
            record["steps"] = len(pipe.run())
        except Exception as err:  # reported with what was measured up to it
            log.exception("the elastic run failed")
            record["error"] = f"{type(err).__name__}: {err}"
        record["wall_s"] = time.monotonic() - record["t0"]
        record["faults"] = pipe.proxy.fault_metrics()
        record["served_by_rank"] = {p["rank"]: [p["node_ip"], p["served"]] for p in pipe.infer.placement()}
        if pipe.elastic is not None:
            record["elastic_clock_offset_s"] = pipe.elastic.t0 - record["t0"]  # events count from the pool's start
            record["events"] = list(pipe.elastic.events)
            record["elastic_totals"] = dict(pipe.elastic.totals)
    finally:
        if pipe is not None:
            pipe.shutdown()
        reward.kill()
    print("RESULT " + json.dumps(record, default=str), flush=True)
    return 1 if "error" in record else 0


# ---------------------------------------------------------------------- the outer side
def run_elastic(
    hosts: Any,
    out: Path,
    *,
    steps: int,
    seed: int = 0,
    fixed: bool = False,
    join_at: int = 2,
    drain_at: int = 7,
    lose_at: int | None = None,
    joining: int = JOINING,
    engine: str = "torch",
    alpha: int = 0,
    channel: str = "ray",
    max_new_tokens: int = 1,
    timeout_s: float = 1500,
    join_host: str = "d",
) -> dict[str, Any]:
    """Run the driver in the head host of ``hosts`` (``head`` with ``H800``, ``b`` with one ``H20``); add the
    host ``join_host`` with ``joining`` H20 devices when the driver asks, drain it when it asks, and remove it
    once Ray reports its node gone. Returns the driver's record plus ``metrics`` (``metrics.jsonl``), ``ledger``
    and ``harness`` (when the host was added, drained, gone)."""
    from rollart.testing import HostSpec

    args = [sys.executable, "-m", "rollart.benchmarks.elastic", "--driver", "--out", str(out)]
    args += ["--steps", str(steps), "--seed", str(seed), "--join-at", str(join_at), "--drain-at", str(drain_at)]
    args += ["--joining", str(joining), "--engine", engine, "--alpha", str(alpha), "--channel", channel]
    args += ["--max-new-tokens", str(max_new_tokens)] + (["--fixed"] if fixed else [])
    args += ["--lose-at", str(lose_at)] if lose_at is not None else []
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "driver.log"
    harness: dict[str, Any] = {}
    threads: list[threading.Thread] = []
    t0 = time.monotonic()

    def add() -> None:
        harness["add_asked_s"] = time.monotonic() - t0
        harness["ip"] = hosts.add_host(HostSpec(join_host, {"H20": joining}, num_cpus=1)).ip
        harness["added_s"] = time.monotonic() - t0

    def kill() -> None:
        harness["kill_asked_s"] = time.monotonic() - t0
        harness["killed_pids"] = len(hosts.kill_host(join_host))

    def restart() -> None:
        harness["restart_asked_s"] = time.monotonic() - t0
        hosts.restart_host(join_host)
        harness["restarted_s"] = time.monotonic() - t0

    def drain() -> None:
        harness["drain_asked_s"] = time.monotonic() - t0
        harness["node_id"] = hosts.drain_host(join_host)
        harness["drained_s"] = time.monotonic() - t0
        harness["gone"] = hosts.wait_host_gone(join_host, timeout_s=600)
        harness["gone_s"] = time.monotonic() - t0
        hosts.remove_host(join_host)
        harness["removed"] = True

    def background(fn: Any) -> None:
        def run() -> None:
            try:
                fn()
            except Exception as err:
                harness.setdefault("errors", []).append(repr(err))

        t = threading.Thread(target=run, daemon=True)
        threads.append(t)
        t.start()

    with log_path.open("w") as log_file:
        proc = hosts.popen("head", args, stdout=subprocess.PIPE, stderr=log_file, text=True)
    result: dict[str, Any] | None = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("NEED add_host"):
                background(add)
            elif line.startswith("NEED kill_host"):
                background(kill)
            elif line.startswith("NEED restart_host"):
                background(restart)
            elif line.startswith("NEED drain_host"):
                background(drain)
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"the elastic run took longer than {timeout_s}s")
        proc.wait(timeout=120)
        for t in threads:
            t.join(timeout=660)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if result is None or proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-6000:]
        raise RuntimeError(f"the elastic driver failed (exit {proc.returncode}; its whole log: {log_path}):\n{tail}")
    result["harness"] = harness
    result["metrics"] = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    result["ledger"] = json.loads((out / "ledger.json").read_text())
    return result


# ---------------------------------------------------------------------- measures
def rates(timeline: list[list[float]], window_s: float = 4.0) -> list[tuple[float, float, int]]:
    """Tokens/s over a sliding ``window_s`` at each sample: ``(t, tokens_per_s, serving workers)``."""
    out = []
    j = 0
    for i, (t, tokens, workers) in enumerate(timeline):
        while timeline[j][0] < t - window_s:
            j += 1
        if i > j:
            t_j, tok_j, _ = timeline[j]
            out.append((t, (tokens - tok_j) / (t - t_j), int(workers)))
    return out


def phases(res: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Tokens/s of rollout with one host, while the joined workers serve, and after they left: the tokens the
    LLMProxy returned over each phase's time (the sampler's timeline, cut by the run's events). The time the
    step loop stood waiting for the join or the drain is left out (rollout stops at the async bound then)."""
    events = res.get("events", [])
    joined = [e["elapsed_s"] for e in events if e["event"] == "joined"]
    draining = [e["elapsed_s"] for e in events if e["event"] == "draining"]
    left = [e["elapsed_s"] for e in events if e["event"] == "left"]
    # the events' clock starts when the elastic pool was made, the timeline's when the driver did: align them
    offset = res.get("elastic_clock_offset_s", 0.0)
    timeline = res["timeline"]
    if len(timeline) < 2:
        return {}
    bounds = {
        "one_host": (timeline[0][0], (min(joined) + offset) if joined else None),
        "two_hosts": ((max(joined) + offset) if joined else None, (min(draining) + offset) if draining else None),
        "after_drain": ((max(left) + offset) if left else None, None),
    }
    waits = res.get("waits", [])
    out = {}
    for name, (start, end) in bounds.items():
        if start is None:
            continue
        tokens = seconds = 0.0
        for (t0, tok0, _), (t1, tok1, _) in zip(timeline, timeline[1:]):
            inside = t0 >= start and (end is None or t1 <= end)
            waiting = any(t0 < w1 and t1 > w0 for w0, w1 in waits)
            if inside and not waiting:
                tokens += tok1 - tok0
                seconds += t1 - t0
        if seconds > 0:
            out[name] = {"tokens_per_s": tokens / seconds, "seconds": seconds}
    return out


def plot(res: dict[str, Any], path: Path) -> Path | None:
    """Tokens/s over time, serving workers, and the node and worker events, as a PNG (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    pts = rates(res["timeline"])
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.2))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:blue", label="rollout tokens/s (4 s window)")
    ax.set_xlabel("time since the driver started (s)")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    ax2.step([p[0] for p in pts], [p[2] for p in pts], where="post", color="tab:green", label="serving workers")
    ax2.set_ylabel("serving workers")
    ax2.set_ylim(0, max(p[2] for p in pts) + 1)
    offset = res.get("elastic_clock_offset_s", 0.0)
    marks = {"node_joined": "tab:orange", "node_draining": "tab:red", "node_left": "tab:gray"}
    for w0, w1 in res.get("waits", []):
        ax.axvspan(w0, w1, color="0.9", zorder=0)  # the step loop waits for the join or the drain
    for e in res.get("events", []):
        if e["event"] in marks:
            ax.axvline(e["elapsed_s"] + offset, color=marks[e["event"]], linestyle="--", linewidth=1)
            ax.text(e["elapsed_s"] + offset, ax.get_ylim()[1] * 0.95, e["event"].replace("node_", "host "), fontsize=7)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, loc="lower center", fontsize=8)
    ax.set_title("elastic rollout: a host joins, serves and is drained")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--join-at", type=int, default=4, help="the host joins after this step (0-based)")
    p.add_argument("--drain-at", type=int, default=12, help="the host is drained after this step")
    p.add_argument("--joining", type=int, default=JOINING, help="H20 devices of the joining host")
    p.add_argument("--engine", default="simulated", choices=["simulated", "torch"])
    p.add_argument("--alpha", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--channel", default="ray", choices=["ray", "mooncake"], help="weights.channel")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/elastic")


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    """Join latencies, throughput per phase and their ratio, the drain, and the ledger."""
    events = res.get("events", [])
    joined = [e for e in events if e["event"] == "joined"]
    left = [e for e in events if e["event"] == "left"]
    ph = phases(res)
    led = res["ledger"]
    out: dict[str, Any] = {
        "workers joined": len(joined),
        "join: node seen -> serving (s)": max((e["since_node_s"] for e in joined), default=None),
        "join: devices free -> serving (s)": max((e["join_s"] for e in joined), default=None),
        "join: worker start / weight load (s)": (
            f"{max(e['start_s'] for e in joined):.2f} / {max(e['load_s'] for e in joined):.2f}" if joined else None
        ),
        "drain: requests finished or moved (s)": max((e.get("drain_s", 0.0) for e in left), default=None),
        "requests moved off the drained workers": sum(int(e.get("migrated", 0)) for e in left),
        "lost / trained twice / invented": f"{led['lost']} / {led['trained_twice']} / "
        f"{led['rewards_invented'] + res['rewards_mismatch']}",
    }
    for name, p in ph.items():
        out[f"tokens/s {name.replace('_', ' ')}"] = p["tokens_per_s"]
    if "one_host" in ph and "two_hosts" in ph:
        out["throughput ratio two hosts / one"] = ph["two_hosts"]["tokens_per_s"] / ph["one_host"]["tokens_per_s"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart.testing import HostSpec, skip_reason, start_hosts

    reason = skip_reason()
    if reason:
        raise SystemExit(f"rollart bench elastic needs namespace hosts: {reason}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    specs = [HostSpec("head", {"H800": 1}, num_cpus=2), HostSpec("b", {"H20": 1}, num_cpus=1)]
    with start_hosts(specs, start_timeout_s=300) as hosts:
        res = run_elastic(
            hosts,
            out / "run",
            steps=args.steps,
            seed=args.seed,
            join_at=args.join_at,
            drain_at=args.drain_at,
            joining=args.joining,
            engine=args.engine,
            alpha=args.alpha,
            channel=args.channel,
            max_new_tokens=args.max_new_tokens,
        )
    png = plot(res, out / "elastic.png")
    result: dict[str, Any] = {
        "bench": "elastic",
        "engine": args.engine + (" (modelled decode time)" if args.engine == "simulated" else ""),
        "weights": args.channel,
        "alpha": args.alpha,
        "steps": len(res["metrics"]),
        **summarise(res),
        "paper_figure": "none published: no peer adds rollout capacity to a running job",
        "harness": res["harness"],
    }
    (out / "elastic.json").write_text(json.dumps({**result, "run": res}, indent=2, default=str))
    result["files"] = [str(out / "elastic.json")] + ([str(png)] if png else [])
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--driver":
        sys.exit(driver_main(sys.argv[2:]))
    raise SystemExit("run `rollart bench elastic`")
