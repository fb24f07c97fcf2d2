"""chaos: an asynchronous run on three namespace hosts survives a seeded schedule of faults — a SIGKILLed
inference worker, every process of one rollout host killed, the reward service restarted, one env
fail-stop and one fail-slow — and loses no trajectory; per fault kind the step-time cost.

The run (:func:`driver_main`, inside the head host) is the agentic pipeline on the tiny model learning
``reverse`` of one letter, scored by :func:`letter_reward` (it rises within a few steps: a sign that
training still works through the faults), ``alpha`` 1, rewards from a real ``rollart serve rewards``
process, inference on one ``H800`` worker (host head or b) and one ``H20`` worker (host c). The
outer side (:func:`run_chaos`) kills host c when the driver asks for it and starts its Ray node again.

The ``trainer`` fault SIGKILLs train rank 0: the trainer side is rebuilt from the latest checkpoint
(``checkpoint_every: 2``), the rounds trained since are played again, and the ledger still balances.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import string
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

log = logging.getLogger("rollart.bench")

FAULT_KINDS = ["inference_worker", "rollout_host", "reward_service", "env_fail_stop", "env_fail_slow", "trainer"]
OPTIONAL_KINDS: dict[str, str] = {}  # kinds listed but skipped, with the reason
NUM_GROUPS, GROUP_SIZE, KEEP, BATCH_GROUPS = 6, 6, 5, 4  # trajectories trained per step: BATCH_GROUPS * KEEP
LOST_HOST = "c"  # the rollout host whose every process is killed (its only worker is the H20 one)


def letter_reward(trajectory: dict[str, Any]) -> float:
    """The chaos run's reward (served by ``rollart serve rewards rollart.benchmarks.chaos:letter_reward``):
    0.5 for answering one lowercase letter and 0.5 more when it is the right one (``reverse`` of one
    letter: the letter itself). The random tiny model scores about 0.04; the first half is learnt within
    a few steps, so a rising reward is a reliable sign that training goes on through the faults."""
    response = str(trajectory["response"]).strip()
    letter = len(response) == 1 and response in string.ascii_lowercase
    return 0.5 * letter + 0.5 * (letter and response == str(trajectory["ground_truth"]))


def count_reward_checks(trajs: list[Any], record: dict[str, Any]) -> None:
    """Rewards invented: every trained reward recomputed from its response and ground truth with
    :func:`letter_reward`; counts ``unverifiable`` and ``rewards_mismatch`` into ``record``."""
    for t in trajs:
        truth, resp = t.scored_on.ground_truth, t.scored_on.response
        if resp is None or truth is None:
            record["unverifiable"] += 1
        elif abs(letter_reward({"response": resp, "ground_truth": truth}) - float(t.reward)) > 1e-9:
            record["rewards_mismatch"] += 1


def schedule(kinds: list[str], steps: int, seed: int, first: int = 3, gap: int = 3) -> dict[int, str]:
    """Step -> fault kind: the kinds in a seeded random order, ``gap`` steps apart from step ``first``
    (each fault has a step to settle before the next). Raises when ``steps`` is too short for them."""
    order = list(kinds)
    random.Random(seed).shuffle(order)
    last = first + gap * (len(order) - 1)
    if last > steps - 2:
        raise ValueError(
            f"{len(order)} faults {gap} steps apart from step {first} need steps >= {last + 2}, got {steps}"
        )
    return {first + gap * i: k for i, k in enumerate(order)}


def config(
    out: Path,
    steps: int,
    reward_url: str,
    seed: int,
    history_keep: int = 1000,
    channel: str = "ray",
    relay: bool = False,
) -> Any:
    """The chaos run's job; ``channel`` is ``weights.channel`` (``ray`` or ``mooncake``), ``relay`` its
    ``weights.relay`` (mooncake)."""
    from rollart.config import PipelineConfig

    return PipelineConfig.model_validate(
        {
            "name": "chaos",
            "seed": seed,
            "pools": {
                "train": {"hardware": "H800", "devices": 1},
                "rollout": [{"hardware": "H800", "devices": 1}, {"hardware": "H20", "devices": 1}],
            },
            "envs": [{"name": "reverse", "groups": NUM_GROUPS, "kwargs": {"length": 1}}],
            # KEEP of GROUP_SIZE members complete a round: a fail-stop or fail-slow member is redundant
            "rollout": {
                "num_env_groups": NUM_GROUPS,
                "group_size": GROUP_SIZE,
                "group_keep": KEEP,
                "batch_groups": BATCH_GROUPS,
                "alpha": 1,
            },
            "sampling": {"temperature": 1.0, "max_new_tokens": 1, "seed": seed},
            "advantage": "grpo",  # the service's reward (grpo_token would learn from the env's own credit)
            "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
            "train": {"lr": 0.02},
            "env_manager": {"step_timeout_s": 2.0, "step_retries": 1},
            "reward": {"url": reward_url, "retries": 4, "timeout_s": 10.0},
            # a soak kills workers again and again: a generous budget in a short window, the backoff capped
            # at 0.2 * 2**5 = 6.4 s
            "fault": {
                "inference": {"max_restarts": 6, "window_s": 60, "backoff_s": 0.2, "on_exhausted": "remove"},
                # at one random fault a minute, up to 10 land in 600 s and any of them may hit the trainer
                # (a trainer fault, or its host killed)
                "train": {"max_restarts": 10, "window_s": 600, "backoff_s": 0.2},
            },
            "steps": steps,
            "history_keep": history_keep,
            "checkpoint_every": 2,  # the trainer fault restores the latest checkpoint
            "weights": {"channel": channel, **({"relay": True} if relay else {})},
            "output_dir": str(out),
            "cluster": {"metadata_store": str(out / "meta.sqlite")},
        }
    )


# ---------------------------------------------------------------------- the reward service
class RewardService:
    """``rollart serve rewards rollart.envs.rewards:reverse`` as a process of its own; :meth:`restart`
    SIGKILLs it and starts a new one on the same port."""

    def __init__(self, port: int):
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{port}/rewards/reverse"

    def start(self, deadline_s: float = 180.0) -> RewardService:
        """Start the service and wait for its ``/healthz``: it answers in ~3 s on an idle 2-core machine; the
        deadline is for a machine loaded by the chaos around it (a restart under a load average of 20+ once
        took more than 60 s), and a service that exits is reported at once."""
        import httpx

        cmd = [
            sys.executable,
            "-m",
            "rollart.cli",
            "serve",
            "rewards",
            "reverse=rollart.benchmarks.chaos:letter_reward",
        ]
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(self.port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            try:
                self.proc.wait(timeout=0.1)  # paces the poll and notices a server that exited
            except subprocess.TimeoutExpired:
                continue
            raise RuntimeError(f"the reward service exited with {self.proc.returncode}")
        raise TimeoutError(f"the reward service did not answer /healthz within {deadline_s}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        self.kill()
        self.start()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------- the driver (head host)
def _ask_outer(what: str) -> None:
    """Ask the outer process (which owns the hosts) to do ``what`` and wait until it is done."""
    print(f"NEED {what}", flush=True)
    line = sys.stdin.readline()
    if not line.startswith("done"):
        raise RuntimeError(f"the outer process did not do {what!r}: {line!r}")


class TimeUp(Exception):
    """A soak run's time is over (raised from the step hook; the run's ``finally`` writes the ledger)."""


def rss_mb(pid: int) -> float | None:
    """Resident memory of ``pid`` in MB (``VmRSS`` of ``/proc/PID/status``); None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def mappings_mb(pid: int, min_mb: float = 1.0) -> dict[str, float] | None:
    """Resident memory of ``pid`` by mapping, in MB, for what holds at least ``min_mb``: a file's mappings
    together under its path, the heap and stacks under their names, an anonymous mapping under its start
    address (``"[anon] 0x7f..."``: the Mooncake segment, glibc's arenas, torch's large blocks), plus
    ``"[anon] all"`` and ``"[anon] count"``. None when the process is gone."""
    out: dict[str, float] = {}
    label = ""
    anon_total = 0.0
    anon_count = 0
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(maxsplit=6)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                    lo = int(head[0].split("-")[0], 16)
                    path = head[5].strip() if len(head) > 5 else ""
                    label = path or f"[anon] {lo:#x}"  # by address alone: a mapping that grows keeps its name
                    if not path:
                        anon_count += 1
                elif head[0] == "Rss:":
                    mb = int(head[1]) / 1024.0
                    out[label] = out.get(label, 0.0) + mb
                    if label.startswith("[anon] 0x"):
                        anon_total += mb
    except OSError:
        return None
    kept = {k: round(v, 2) for k, v in out.items() if v >= min_mb}
    kept["[anon] all"] = round(anon_total, 2)
    kept["[anon] count"] = float(anon_count)
    return kept


def make_pipeline(
    cfg: Any,
    plan: dict[int, str],
    reward: RewardService,
    record: dict[str, Any],
    *,
    deadline: float | None = None,
    sample_s: float = 60.0,
    every_s: float = 0.0,
    kinds: list[str] | None = None,
    seed: int = 0,
    snapshots: list[Any] | None = None,
    snapshot_after_s: float = 0.0,
    train_frames: int = 0,
) -> Any:
    """The agentic pipeline with a hook after every step that injects the fault planned for it; with a
    ``deadline`` (soak) it samples the resident memory of the driver, of every worker and of the reward
    service every ``sample_s`` seconds and ends the run with :class:`TimeUp` at the deadline; with
    ``every_s`` a fault drawn from ``kinds`` (seeded) is added to ``plan`` every ``every_s`` seconds.
    While :mod:`tracemalloc` traces, the first sample after ``snapshot_after_s`` also appends a snapshot
    of the driver's allocations to ``snapshots`` (the baseline of
    :func:`rollart.cluster.allocations.allocation_growth`). With ``train_frames`` the train ranks trace
    theirs too (started at the first sample, their baseline taken with the driver's; the pipeline's
    ``train_allocations`` reports them)."""
    rng = random.Random(seed)
    last_fault: list[float] = []  # the first step's time: no fault before the run has started
    injected_at: set[int] = set()  # the steps whose fault was injected
    import ray

    from rollart.envs.faults import FailingEnv, LatencyEnv
    from rollart.pipelines.agentic import AgenticPipeline

    class ChaosPipeline(AgenticPipeline):
        next_sample = 0.0

        def _sample(self) -> None:
            now = time.monotonic()
            if now < self.next_sample:
                return
            self.next_sample = now + sample_s
            procs = {"driver": os.getpid()}
            procs.update({f"infer{r}": pid for r, pid in self.infer.pids().items()})
            procs.update({f"train{r}": pid for r, pid in self.train.pids().items()})
            if reward.proc is not None:
                procs["reward_service"] = reward.proc.pid
            master = getattr(self.weights, "master", None)  # the Mooncake master rollart started, if any
            if master is not None and master.pid is not None:
                procs["mooncake_master"] = master.pid
            try:
                caches = self.host_caches()
            except ray.exceptions.RayError:  # a cache on a host being killed: sampled next time
                caches = []
            procs.update({f"host_cache@{c['node_ip']}": c["pid"] for c in caches})
            t = now - record["t0"]
            for name, pid in procs.items():
                mb = rss_mb(pid)
                if mb is not None:
                    record["rss"].setdefault(f"{name}:{pid}", []).append((t, mb))
                if name.startswith("train") and (maps := mappings_mb(pid)) is not None:  # where a rank grows
                    record["mappings"].setdefault(f"{name}:{pid}", []).append((t, maps))
            if train_frames and not record.get("train_tracing"):
                ray.get([w._rollart_allocations.remote("start", train_frames) for w in self.train.workers])
                record["train_tracing"] = True
            if snapshots is not None and not snapshots and tracemalloc.is_tracing() and t >= snapshot_after_s:
                snapshots.append(tracemalloc.take_snapshot())
                record["tracemalloc_baseline_s"] = t
                if train_frames:
                    ray.get([w._rollart_allocations.remote("baseline") for w in self.train.workers])

        async def on_step_end(self, step: int, step_record: dict[str, Any], trajs: list[Any]) -> None:
            if deadline is not None:
                self._sample()
                if time.monotonic() > deadline:
                    raise TimeUp(f"soak time over after step {step}")
            count_reward_checks(trajs, record)  # rewards invented: every trained reward recomputed
            if not last_fault:
                last_fault.append(time.monotonic())
            if every_s > 0 and kinds and time.monotonic() - last_fault[0] >= every_s:
                plan[step] = rng.choice(kinds)
            # each planned fault once: a step done again after a trainer restore does not repeat its fault
            kind = plan.get(step) if step not in injected_at else None
            if kind is not None:
                last_fault[0] = time.monotonic()
                injected_at.add(step)
                at = round(time.monotonic() - record["t0"], 1)  # the memory samples' clock
                record["injected"].append({"step": step, "kind": kind, "detail": self._inject(kind), "t": at})
            if step - 3 in plan and plan[step - 3] in ("env_fail_stop", "env_fail_slow"):
                self._heal_env(plan[step - 3])  # an env fault lasts three steps

        def train_allocations(self) -> list[tuple[list[dict[str, Any]], str]]:
            """Each train rank's allocations grown since its baseline (``train_frames``)."""
            return ray.get([w._rollart_allocations.remote("grown") for w in self.train.workers])

        def host_caches(self) -> list[dict[str, Any]]:
            """``host_cache_stats`` of the Mooncake channel's host caches; none on another channel."""
            if self.config.weights.channel != "mooncake":
                return []
            from rollart.weights.host_cache import host_cache_stats

            return host_cache_stats(self.weights.channel.name)

        def _worker(self, hardware: str) -> int:
            """The pid of the live inference worker on ``hardware`` (another may be down: a killed host's
            worker until its restart)."""
            for w in self.infer.workers:
                try:
                    info = ray.get(w._rollart_info.remote(), timeout=60)
                except ray.exceptions.RayError:
                    continue
                if info["hardware"] == hardware:
                    return int(info["pid"])
            raise RuntimeError(f"no live inference worker on {hardware} to kill")

        def _inject(self, kind: str) -> str:
            if kind == "inference_worker":  # the H800 worker: restarted in its bundle
                pid = self._worker("H800")
                os.kill(pid, signal.SIGKILL)
                return f"SIGKILL inference worker pid {pid} (H800)"
            if kind == "rollout_host":
                if caches := self.host_caches():  # where each host read from so far (its cache dies with it)
                    record["host_caches_before_kill"] = caches
                _ask_outer(f"kill_host {LOST_HOST}")
                return f"every process of host {LOST_HOST} killed (H20 worker), its Ray node started again"
            if kind == "reward_service":
                old = reward.proc.pid if reward.proc else None
                reward.restart()
                return (
                    f"reward service pid {old} SIGKILLed, restarted as pid {reward.proc.pid if reward.proc else None}"
                )
            if kind == "env_fail_stop":  # every step of one member of group 0 hangs (3 s), past the 2 s timeout
                mgr = self.scheduler.groups[0][0]
                mgr.env = FailingEnv(mgr.env, fail_prob_step=1.0, hang=True, hang_timeout_s=3.0, seed=0)
                return "group 0 member 0: every step hangs for 3 s (step_timeout_s 2)"
            if kind == "env_fail_slow":  # one member of group 1 takes 1.5 s per step
                mgr = self.scheduler.groups[1][0]
                mgr.env = LatencyEnv(mgr.env, step_latency=lambda: 1.5)
                return "group 1 member 0: 1.5 s per step"
            if kind == "trainer":
                pid = self.train.pids()[0]
                os.kill(pid, signal.SIGKILL)
                return f"SIGKILL train rank 0 pid {pid}"
            raise ValueError(f"unknown fault kind {kind!r}")

        def _heal_env(self, kind: str) -> None:
            mgr = self.scheduler.groups[0 if kind == "env_fail_stop" else 1][0]
            wrapper = FailingEnv if kind == "env_fail_stop" else LatencyEnv
            while isinstance(mgr.env, wrapper):
                if isinstance(mgr.env, FailingEnv):  # steps that hung (then failed or were aborted)
                    record["env_hangs"] += mgr.env.failures
                else:
                    record["env_slow_s"] += mgr.env.total_latency
                mgr.env = mgr.env.env

    return ChaosPipeline(cfg, progress=False)


def driver_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan", required=True, help="JSON {step: kind}")
    p.add_argument("--channel", default="ray", choices=["ray", "mooncake"], help="weights.channel")
    p.add_argument("--relay", action="store_true", help="weights.relay (mooncake)")
    p.add_argument("--minutes", type=float, default=0.0, help="soak: run this long (steps is then an upper bound)")
    p.add_argument("--sample-s", type=float, default=60.0, help="soak: seconds between memory samples")
    p.add_argument("--fault-every-s", type=float, default=0.0, help="soak: a random fault this often")
    p.add_argument("--kinds", default="", help="soak: the fault kinds to draw from (comma-separated)")
    p.add_argument(
        "--tracemalloc", type=int, default=0, help="soak: trace the driver's allocations with this many frames"
    )
    p.add_argument(
        "--tracemalloc-train", type=int, default=0, help="soak: trace the train ranks' too (with --tracemalloc)"
    )
    a = p.parse_args(argv)
    snapshots: list[Any] = []
    if a.tracemalloc > 0:
        tracemalloc.start(a.tracemalloc)
    logging.basicConfig(level=logging.WARNING)
    plan = {int(k): v for k, v in json.loads(a.plan).items()}
    out = Path(a.out)
    reward = RewardService(free_port()).start()
    record: dict[str, Any] = {
        "injected": [],
        "rewards_mismatch": 0,
        "unverifiable": 0,
        "rss": {},
        "mappings": {},
        "env_hangs": 0,
        "env_slow_s": 0.0,
    }
    pipe = None
    try:
        record["t0"] = t0 = time.monotonic()
        deadline = t0 + 60.0 * a.minutes if a.minutes > 0 else None
        # a soak keeps 50 step records in memory (the default 1000 fills only after ~15 minutes here), so
        # a slope measured past the first minute is growth beyond the bounded history
        cfg = config(
            out,
            a.steps,
            reward.url,
            a.seed,
            history_keep=50 if a.minutes > 0 else 1000,
            channel=a.channel,
            relay=a.relay,
        )
        pipe = make_pipeline(
            cfg,
            plan,
            reward,
            record,
            deadline=deadline,
            sample_s=a.sample_s,
            every_s=a.fault_every_s,
            kinds=[k for k in a.kinds.split(",") if k],
            seed=a.seed,
            snapshots=snapshots,
            snapshot_after_s=15.0 * a.minutes,  # a quarter of the run: past the warm-up
            train_frames=a.tracemalloc_train,
        )
        try:
            record["steps"] = len(pipe.run())
        except TimeUp:
            record["steps"] = sum(1 for _ in (out / "metrics.jsonl").open())
        except Exception as err:  # reported with what was measured up to it
            log.exception("the chaos run failed")
            record["error"] = f"{type(err).__name__}: {err}"
            record["steps"] = sum(1 for _ in (out / "metrics.jsonl").open()) if (out / "metrics.jsonl").exists() else 0
        record["wall_s"] = time.monotonic() - t0
        record["faults"] = pipe.proxy.fault_metrics()
        record["events"] = [e["event"] for e in pipe.proxy.supervisor.events] if pipe.proxy.supervisor else []
        if caches := pipe.host_caches():  # where each host read each version from
            record["host_caches"] = caches
            from rollart.weights.host_cache import host_cache_stats

            # the channels a trainer restart replaced: their host caches (memory, relay copies) are gone
            record["retired_channels"] = {n: host_cache_stats(n) for n in getattr(pipe.weights, "retired", [])}
        if snapshots:
            from rollart.cluster.allocations import allocation_growth

            rows, text = allocation_growth(snapshots[0], tracemalloc.take_snapshot())
            record["allocation_growth"] = rows
            (out / "tracemalloc.txt").write_text(text)
            if a.tracemalloc_train:
                for rank, (rows, text) in enumerate(pipe.train_allocations()):
                    record.setdefault("train_allocation_growth", {})[str(rank)] = rows
                    (out / f"tracemalloc_train{rank}.txt").write_text(text)
    finally:
        if pipe is not None:
            pipe.shutdown()
        reward.kill()
    print("RESULT " + json.dumps(record), flush=True)
    return 1 if "error" in record else 0


# ---------------------------------------------------------------------- the outer side
def run_chaos(
    hosts: Any,
    out: Path,
    *,
    steps: int,
    seed: int,
    kinds: list[str],
    timeout_s: float = 900,
    plan: dict[int, str] | None = None,
    extra: list[str] | None = None,
    keep_failed: bool = False,
    channel: str = "ray",
    relay: bool = False,
) -> dict:
    """Run the driver in the head host of ``hosts`` (a :class:`~rollart.testing.hosts.HostCluster` from
    :func:`~rollart.testing.hosts.three_hosts`) with the seeded plan; serve its requests to kill a host.
    Returns the driver's record plus ``plan``, ``metrics`` (``metrics.jsonl``) and ``ledger``. A failed
    run raises, unless ``keep_failed`` (the soak): then the record comes back with its ``error``.
    ``channel`` and ``relay``: how weights reach the workers (``weights.channel``, ``weights.relay``)."""
    plan = schedule(kinds, steps, seed) if plan is None else plan
    args = [sys.executable, "-m", "rollart.benchmarks.chaos", "--driver"]
    args += ["--out", str(out), "--steps", str(steps), "--seed", str(seed), "--plan", json.dumps(plan)]
    args += ["--channel", channel] + (["--relay"] if relay else [])
    args += extra or []
    # the driver's log goes to a file: whole, kept for a failure's cause, and no pipe to fill while stdout is read
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "driver.log"
    with log_path.open("w") as log_file:
        proc = hosts.popen("head", args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True)
    result: dict[str, Any] | None = None
    deadline = time.monotonic() + timeout_s
    try:
        assert proc.stdout is not None and proc.stdin is not None
        for line in proc.stdout:
            if line.startswith("NEED kill_host "):
                name = line.split()[-1]
                hosts.kill_host(name)
                _restart_host(hosts, name)
                proc.stdin.write("done\n")
                proc.stdin.flush()
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
            if time.monotonic() > deadline:
                raise TimeoutError(f"the chaos run took longer than {timeout_s}s")
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if result is None or (proc.returncode != 0 and not (keep_failed and "error" in result)):
        tail = log_path.read_text(errors="replace")[-6000:]
        raise RuntimeError(f"the chaos driver failed (exit {proc.returncode}; its whole log: {log_path}):\n{tail}")
    result["plan"] = (
        {str(i["step"]): i["kind"] for i in result["injected"]} if extra else {str(k): v for k, v in plan.items()}
    )
    # one record per step: a step done again after a trainer restore appears again later in the file
    by_step = {m["step"]: m for m in (json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines())}
    result["metrics"] = [by_step[k] for k in sorted(by_step)]
    result["ledger"] = json.loads((out / "ledger.json").read_text())
    return result


def _restart_host(hosts: Any, name: str, tries: int = 3) -> bool:
    """Start the Ray node of host ``name`` again; on a loaded machine Ray's own 30 s start-up wait can
    run out, so it is tried ``tries`` times. When every try fails the run goes on without the host
    (its worker is removed after its restarts: still a survived fault); returns whether it came back."""
    from rollart.testing.hosts import HostsError

    for i in range(tries):
        try:
            hosts.restart_host(name)
            return True
        except HostsError as err:
            log.warning("restarting host %s failed (try %d of %d): %s", name, i + 1, tries, str(err)[-300:])
    return False


def step_cost(metrics: list[dict[str, Any]], plan: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per fault kind: the step time of the fault's step and the next one (mean) and its excess over
    the run's median step time (the fault is injected after its step's record: its cost shows in the
    following steps)."""
    times = {m["step"] - 1: m["time"]["step_s"] for m in metrics}  # by the 0-based index the plan uses
    median = statistics.median(times.values())
    out = {}
    for step, kind in plan.items():
        around = [times[s] for s in (int(step) + 1, int(step) + 2) if s in times]
        mean = sum(around) / len(around) if around else float("nan")
        out[kind] = {"step_s": mean, "median_step_s": median, "cost_s": mean - median}
    return out


def summarise(res: dict[str, Any], alpha: int = 1) -> dict[str, Any]:
    metrics, led = res["metrics"], res["ledger"]
    rewards = [m["reward_mean"] for m in metrics]
    k = max(1, len(rewards) // 4)
    return {
        "steps": len(metrics),
        "injected": [i["kind"] for i in res["injected"]],
        "survived": len(metrics) == res["steps"],
        "lost": led["lost"],
        "trained_twice": led["trained_twice"],
        "rewards_invented": led["rewards_invented"] + res["rewards_mismatch"],
        "max_staleness": max(m["max_staleness"] for m in metrics),
        "staleness_ok": all(m["max_staleness"] <= alpha for m in metrics),
        "reward_first": sum(rewards[:k]) / k,
        "reward_last": sum(rewards[-k:]) / k,
        "cost": step_cost(metrics, res["plan"]),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0, help="the seed of the fault schedule (and of the run)")
    p.add_argument(
        "--kinds",
        default=",".join(FAULT_KINDS),
        help=f"comma-separated fault kinds (of {FAULT_KINDS + list(OPTIONAL_KINDS)}); optional ones are skipped "
        "with a note unless listed here",
    )
    add_weight_arguments(p)
    p.add_argument("--out", default="runs/bench/chaos")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_weight_arguments(p: argparse.ArgumentParser) -> None:
    """``--channel`` and ``--relay`` of the chaos and soak runs."""
    p.add_argument(
        "--channel",
        default="ray",
        choices=["ray", "mooncake"],
        help="weights.channel: how new weights reach the workers (the trainer fault and the host kill hit it)",
    )
    p.add_argument("--relay", action="store_true", help="mooncake: weights.relay (hosts read from each other)")


def check_weight_arguments(args: argparse.Namespace) -> None:
    if args.relay and args.channel != "mooncake":
        raise SystemExit("--relay: the relay is the mooncake channel's; add --channel mooncake")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart.testing import skip_reason, start_hosts, three_hosts

    reason = skip_reason()
    if reason:
        raise SystemExit(f"rollart bench chaos needs namespace hosts: {reason}")
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(FAULT_KINDS) - set(OPTIONAL_KINDS)
    if unknown:
        raise SystemExit(f"--kinds: unknown {sorted(unknown)}; choose from {FAULT_KINDS + list(OPTIONAL_KINDS)}")
    check_weight_arguments(args)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with start_hosts(three_hosts(), start_timeout_s=300) as hosts:
        res = run_chaos(
            hosts, out / "run", steps=args.steps, seed=args.seed, kinds=kinds, channel=args.channel, relay=args.relay
        )
    s = summarise(res)
    skipped = {k: v for k, v in OPTIONAL_KINDS.items() if k not in kinds}
    result: dict[str, Any] = {
        "bench": "chaos",
        "seed": args.seed,
        "weights": args.channel + (" (relay)" if args.relay else ""),
        "steps": s["steps"],
        "trajectories lost": s["lost"],
        "trained twice": s["trained_twice"],
        "rewards invented": s["rewards_invented"],
        "max staleness (alpha 1)": s["max_staleness"],
        "reward first/last quarter": f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}",
        "ledger": res["ledger"],
        "faults": res["faults"],
        "plan": res["plan"],
        "per_kind": {},
    }
    for step, kind in res["plan"].items():
        c = s["cost"][kind]
        result["per_kind"][kind] = {"step": int(step), "injected": 1, "survived": int(s["survived"]), **c}
        result[f"{kind} (step {step})"] = (
            f"injected 1, survived {int(s['survived'])}, step {c['step_s']:.2f} s vs median "
            f"{c['median_step_s']:.2f} s ({c['cost_s']:+.2f} s)"
        )
    for kind, note in skipped.items():
        result[kind] = note
    result["skipped"] = skipped
    (out / "chaos.json").write_text(json.dumps({**result, "run": res}, indent=2, default=str))
    result["files"] = [str(out / "chaos.json")]
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--driver":
        sys.exit(driver_main(sys.argv[2:]))
    raise SystemExit("run `rollart bench chaos`")
