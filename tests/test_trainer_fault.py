"""Trainer supervision on a real local Ray (issue #13): a trainer rank's process is SIGKILLed mid-run
(pid asked from the actor), the pipeline rebuilds every data-parallel rank in its bundle, reloads the
latest checkpoint (or the initial weights), plays the rounds trained since again without training any
round twice, and pushes the reloaded weights to the inference workers as a new version; once
``fault.train`` is spent the job fails naming the rank, its host and the cause."""

import asyncio
import os
import signal

import pytest
import ray

from rollart.cluster.fault import TrainerFailed
from rollart.pipelines.agentic import AgenticPipeline

pytestmark = pytest.mark.timeout(900)


def kill(cluster, rank: int) -> int:
    """SIGKILL the process of ``rank``'s actor (its pid asked from the actor); returns the pid."""
    pid = ray.get(cluster.workers[rank]._rollart_info.remote(), timeout=60)["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def killing_pipeline(kills: list[tuple[int, int]]):
    """A pipeline that SIGKILLs trainer ranks: ``(step, rank)`` in order, each once, when ``step`` has
    been trained; it records what the inference workers serve right after each recovery."""
    todo = list(kills)

    class Killing(AgenticPipeline):
        killed: list = []
        after_recovery: list = []

        async def on_step_end(self, step, record, trajs):
            if todo and todo[0][0] == step:
                self.killed.append((step, kill(self.train, todo.pop(0)[1])))

        async def on_trainer_recovered(self, recovery):
            served = [m["weight_version"] for m in await self.proxy.worker_metrics()]
            sums = await self.train.weight_checksum(blocking=False)
            saved = None
            if self.recoveries[-1]["checkpoint"] is not None:  # read now: later saves delete old folders
                from safetensors.torch import load_file

                state = load_file(os.path.join(self.recoveries[-1]["checkpoint"], "model.safetensors"))
                saved = float(sum(t.abs().sum() for t in state.values() if t.is_floating_point()))
            self.after_recovery.append({"served": served, "checksums": sums, "pids": self.train.pids(), "saved": saved})

    Killing.killed, Killing.after_recovery = [], []
    return Killing


def test_a_killed_ddp_trainer_rank_is_rebuilt_from_the_checkpoint_and_nothing_is_trained_twice(ray_local, tmp_path):
    """Two DDP ranks, a checkpoint every 2 steps; rank 0 is killed once step 2 is trained. Step 3 finds
    it dead; both ranks are rebuilt, reload the checkpoint of step 2 (optimizer and version too), and
    steps 2 and 3 are trained again on rounds no earlier step trained."""
    from test_pipeline import small_config

    cfg = small_config(
        tmp_path,
        pools={"train": {"hardware": "CPU", "cpus": 2}, "rollout": {"hardware": "CPU", "cpus": 1}},
        steps=4,
        checkpoint_every=2,
        fault={"train": {"max_restarts": 1, "backoff_s": 0}},
    )
    pipe = killing_pipeline([(2, 0)])(cfg, progress=False)
    try:
        old_pids = pipe.train.pids()
        history = pipe.run()
        counts = pipe.scheduler.counts
        served_end = [m["weight_version"] for m in ray.get([w.metrics.remote() for w in pipe.infer.workers])]
        bundles = [(s.group.placement_group.id, s.bundle_index) for s in pipe.train._slots]
    finally:
        pipe.shutdown()
    (rec,) = pipe.recoveries
    assert rec["role"] == "train" and rec["rank"] == 0 and rec["host"] == "127.0.0.1"
    assert rec["failed_step"] == 4 and rec["restored_step"] == 2 and rec["checkpoint"].endswith("step-00000002")
    assert "ActorDiedError" in rec["cause"] or "RayActorError" in rec["cause"]
    # every rank is a new process in its bundle; both hold the checkpoint's weights
    (after,) = pipe.after_recovery
    assert set(after["pids"].values()).isdisjoint(old_pids.values())
    assert len(bundles) == 2 and len(set(bundles)) == 2
    assert after["checksums"][0] == pytest.approx(after["checksums"][1])
    assert after["checksums"][0] == pytest.approx(after["saved"], rel=1e-5)
    # the inference workers serve the reloaded weights under a version newer than any before
    assert rec["version"] > 3 and after["served"] == [rec["version"]]
    assert served_end == [history[-1]["version"]]
    # the step counter: each step once in the history, versions only move forward
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    versions = [h["version"] for h in history]
    assert versions == sorted(set(versions)) and versions[:2] == [1, 2] and versions[2] == rec["version"] + 1
    assert history[-1]["trainer_restarts"] == 1
    # no round trained twice: the rounds of the final history are distinct, the ledger saw no repeat,
    # and what the rewind undid (step 2 trained, step 3's batch) is counted as rolled back
    rounds = [g for h in history for g in h["groups"]]
    assert len(rounds) == len(set(rounds)) == 4 * cfg.rollout.batch_groups
    per_step = cfg.rollout.batch_groups * cfg.rollout.group_size
    assert counts["rounds_trained_twice"] == 0 and counts["trainer_restarts"] == 1
    assert counts["trajectories_rolled_back"] == 2 * per_step
    assert counts["trajectories_trained"] - counts["trajectories_rolled_back"] == 4 * per_step


def test_without_a_checkpoint_the_initial_weights_come_back_then_a_spent_policy_fails_the_job(ray_local, tmp_path):
    """One rank, no checkpoint, ``fault.train.max_restarts: 1``: the first kill restarts from the
    initial weights (step 0 again); the second fails the job naming the rank, host and cause."""
    from test_pipeline import small_config

    cfg = small_config(tmp_path, steps=3, checkpoint_every=0, fault={"train": {"max_restarts": 1, "backoff_s": 0}})
    pipe = killing_pipeline([(0, 0), (0, 0)])(cfg, progress=False)
    try:
        initial = pipe.train.weight_checksum()[0]
        with pytest.raises(TrainerFailed) as err:
            pipe.run()
    finally:
        pipe.shutdown()
    (rec,) = pipe.recoveries
    assert rec["checkpoint"] is None and rec["restored_step"] == 0 and rec["failed_step"] == 2
    assert pipe.after_recovery[0]["checksums"] == [pytest.approx(initial)]
    assert pipe.after_recovery[0]["served"] == [rec["version"]]
    assert len(pipe.killed) == 2
    msg = str(err.value)
    assert "train rank 0 (actor_train on CPU, host 127.0.0.1) died" in msg
    assert "fault.train allows 1 restart(s)" in msg and "ActorDiedError" in msg + repr(err.value.__cause__)


def test_remove_is_refused_for_trainer_roles(tmp_path):
    from rollart.cluster.config import FaultConfig

    with pytest.raises(ValueError, match=r"fault.critic.on_exhausted: 'remove' is not possible"):
        FaultConfig.model_validate({"critic": {"on_exhausted": "remove"}})
    assert asyncio.iscoroutinefunction(AgenticPipeline._recover_training)


def test_the_store_keeps_every_attempt_of_a_job_and_closes_the_one_of_a_lost_driver(tmp_path):
    """A driver killed mid-run leaves its attempt open; the next attempt (``--resume``) closes it as
    ``driver_lost``; ``rollart status --json`` lists both."""
    import json
    import subprocess
    import sys

    from rollart.resource_manager.store import MetadataStore

    db = tmp_path / "meta.sqlite"
    code = (
        "import os, sys; from rollart.resource_manager.store import MetadataStore;"
        f"MetadataStore({str(db)!r}).start_run('job-a'); os.kill(os.getpid(), 9)"
    )
    assert subprocess.run([sys.executable, "-c", code], env=dict(os.environ)).returncode == -9
    store = MetadataStore(db)
    assert store.start_run("job-a") == 2
    store.end_run("job-a", "failed", "TrainerFailed('train rank 0 ...')")
    runs = store.runs("job-a")
    assert [(r["attempt"], r["status"]) for r in runs] == [(1, "driver_lost"), (2, "failed")]
    assert runs[1]["cause"].startswith("TrainerFailed") and all(r["ended_at"] for r in runs)
    out = subprocess.run(
        [sys.executable, "-m", "rollart.cli", "status", "--local", "--store", str(db), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert [r["status"] for r in json.loads(out.stdout)["runs"]] == ["driver_lost", "failed"]
