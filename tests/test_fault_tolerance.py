"""Fault tolerance of the rollout on a real local Ray (issue #13): inference worker processes are killed
with SIGKILL (pid from the actor itself); control calls skip them, the restart policy brings them back
with the served weights or removes them, requests in flight move to a healthy worker from their stored
state, errors reach ``get_batch`` instead of hanging it, and the bookkeeping stays bounded."""

import asyncio
import os
import signal

import pytest
import ray
from rollout_fixtures import CharCodec, CountEnv, simulated_cluster

# imported (and assertion-rewritten) at collection, before any Ray thread runs: Python 3.11's ast state is not
# thread-safe, and a Ray thread formatting a traceback (which parses source) while a test imports a test
# module can corrupt it
from test_pipeline import small_config

import rollart as ra
from rollart.cluster.config import FaultConfig, RestartPolicy
from rollart.cluster.errors import NoLiveWorkerError, WorkerDiedError
from rollart.cluster.fault import RestartBudget
from rollart.config import ConfigError, load_config
from rollart.engines.base import SamplingParams
from rollart.rollout.config import RolloutConfig
from rollart.rollout.env_manager import EnvManager
from rollart.rollout.inference_worker import inference_worker_class
from rollart.rollout.ledger import RoundLedger
from rollart.rollout.llm_proxy import LLMProxy
from rollart.rollout.sample_buffer import RolloutError
from rollart.rollout.scheduler import RolloutScheduler
from rollart.rollout.types import GenerateRequest

pytestmark = pytest.mark.timeout(300)


def kill(cluster, rank: int) -> int:
    """SIGKILL the process of ``rank``'s actor (its pid asked from the actor); returns the pid."""
    pid = ray.get(cluster.workers[rank]._rollart_info.remote(), timeout=60)["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def request(rid, n=8, prompt=(5, 6, 7)):
    return GenerateRequest(request_id=rid, prompt_token_ids=list(prompt), sampling=SamplingParams(max_new_tokens=n))


async def running_on(cluster, n: int = 1) -> int:
    """The rank that has ``n`` requests in its engine (waits for it, bounded)."""
    async with asyncio.timeout(60):
        while True:
            for m in await cluster.metrics():
                if m["running"] >= n:
                    return m["rank"]
            await asyncio.sleep(0.01)


async def events(proxy, kind: str, count: int = 1):
    """Wait (bounded) until the supervisor recorded ``count`` events of ``kind``."""
    ok = await asyncio.to_thread(
        proxy.supervisor.wait_for, lambda ev: sum(e["event"] == kind for e in ev) >= count, 120
    )
    assert ok, proxy.supervisor.events
    return [e for e in proxy.supervisor.events if e["event"] == kind]


# ---------------------------------------------------------------------- config
def test_restart_policy_defaults_and_errors(tmp_path):
    f = FaultConfig()
    assert (f.inference.max_restarts, f.inference.window_s, f.inference.on_exhausted) == (2, 300.0, "remove")
    assert f.train.on_exhausted == "fail"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "pools: {train: {hardware: CPU, cpus: 1}, rollout: {hardware: CPU, cpus: 1}}\n"
        "envs: [{name: reverse, groups: 8}]\nfault: {inference: {on_exhausted: retry}}\n"
    )
    with pytest.raises(ConfigError, match="fault.inference.on_exhausted"):
        load_config(cfg)
    cfg.write_text(
        "pools: {train: {hardware: CPU, cpus: 1}, rollout: {hardware: CPU, cpus: 1}}\n"
        "envs: [{name: reverse, groups: 8}]\nfault: {inference: {max_restarts: 3, backoff_s: 0}}\n"
    )
    assert load_config(cfg).fault.inference.max_restarts == 3


@pytest.mark.parametrize(("role", "instead"), [("env", "env_manager.reset_retries"), ("reward", "reward.retries")])
def test_restart_policies_rollart_would_not_enforce_are_refused(tmp_path, role, instead):
    """``fault.env`` and ``fault.reward`` would restart nothing (rollart starts no such processes to
    restart): a config that sets one is refused, naming the field and what handles those faults."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "pools: {train: {hardware: CPU, cpus: 1}, rollout: {hardware: CPU, cpus: 1}}\n"
        f"envs: [{{name: reverse, groups: 8}}]\nfault: {{{role}: {{max_restarts: 5}}}}\n"
    )
    with pytest.raises(ConfigError, match=rf"fault.{role}: .*remove fault.{role} .*{instead}"):
        load_config(cfg)
    assert not {"env", "reward"} & set(FaultConfig.model_fields)


def test_restart_budget_counts_restarts_inside_the_window():
    now = [0.0]
    budget = RestartBudget(RestartPolicy(max_restarts=2, window_s=10, backoff_s=1), clock=lambda: now[0])
    assert budget.take(0) == 1 and budget.take(0) == 2  # backoff doubles inside the window
    assert budget.take(0) is None and budget.take(1) == 1  # per rank
    now[0] = 10.5
    assert budget.take(0) == 1  # the old restarts left the window


# ---------------------------------------------------------------------- control calls and restarts
async def test_control_calls_skip_a_dead_worker_and_fail_with_the_cause_when_none_is_left(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 2}})
    cluster = simulated_cluster(rm, "rollout")
    proxy = LLMProxy(cluster, restart=RestartPolicy(max_restarts=0, on_exhausted="remove"))
    try:
        kill(cluster, 0)
        await proxy.suspend()  # the first call on the dead rank finds it dead: skipped, policy applied
        await proxy.model_update({}, 1)
        await proxy.resume()
        await events(proxy, "removed")
        assert [(m["rank"], m["weight_version"]) for m in await proxy.worker_metrics()] == [(1, 1)]
        out = await proxy.generate(request("after"), "x")
        assert out.rank == 1 and out.token_versions == [1] * 8
        kill(cluster, 1)
        with pytest.raises(WorkerDiedError) as err:  # none alive, none coming back: fail with the cause
            await proxy.model_update({}, 2)
        assert isinstance(err.value.cause, ray.exceptions.RayActorError)
        with pytest.raises(NoLiveWorkerError):
            await proxy.generate(request("none left"), "x")
    finally:
        proxy.close()
        cluster.shutdown()


async def test_a_restarted_worker_serves_the_current_version_then_leaves_when_its_restarts_are_spent(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 2}})
    cluster = simulated_cluster(rm, "rollout")
    proxy = LLMProxy(cluster, restart=RestartPolicy(max_restarts=1, backoff_s=0.0))
    try:
        await proxy.model_update({}, 3)
        bundle = (cluster._slots[0].group.placement_group.id, cluster._slots[0].bundle_index)
        actor_class = cluster.actors.actor_class
        old_pid = kill(cluster, 0)
        await proxy.model_update({}, 4)  # finds rank 0 dead: skipped, restart starts
        await proxy.model_update({}, 5)  # may run while rank 0 is coming back: it must end at 5 either way
        (restarted,) = await events(proxy, "restarted")
        assert restarted["rank"] == 0 and restarted["version"] == 5
        assert sorted((m["rank"], m["weight_version"]) for m in await proxy.worker_metrics()) == [(0, 5), (1, 5)]
        assert cluster.pids()[0] != old_pid
        assert (cluster._slots[0].group.placement_group.id, cluster._slots[0].bundle_index) == bundle
        # the restart reused the pool's Ray actor class: none is built, pickled and exported per fault
        assert actor_class is not None and cluster.actors.actor_class is actor_class
        outs = await asyncio.gather(*(proxy.generate(request(f"r{i}"), "x") for i in range(4)))
        assert {o.rank for o in outs} == {0, 1} and all(o.token_versions == [5] * 8 for o in outs)
        kill(cluster, 0)  # its one restart is spent: removed, the job goes on with rank 1
        await proxy.model_update({}, 6)
        await events(proxy, "removed")
        assert [(m["rank"], m["weight_version"]) for m in await proxy.worker_metrics()] == [(1, 6)]
        assert cluster.fault_counts["restarts"] == 1 and cluster.fault_counts["removed"] == 1
    finally:
        proxy.close()
        cluster.shutdown()


async def test_repeated_restarts_reuse_the_supervisors_threads(make_rm):
    """Every restart used to start a thread of its own; over a long run with faults that was most of
    the driver's memory growth (a new malloc arena now and then). Restarts now run on reused threads:
    four restarts one after the other, of two ranks, need one thread."""
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 2}})
    cluster = simulated_cluster(rm, "rollout")
    proxy = LLMProxy(cluster, restart=RestartPolicy(max_restarts=10, backoff_s=0.0))
    try:
        for n in range(1, 4):
            kill(cluster, 0)
            await proxy.model_update({}, n)  # finds rank 0 dead: restart
            await events(proxy, "restarted", n)
        kill(cluster, 1)
        await proxy.model_update({}, 4)
        await events(proxy, "restarted", 4)
        assert proxy.supervisor.restart_threads == 1
        assert sorted((m["rank"], m["weight_version"]) for m in await proxy.worker_metrics()) == [(0, 4), (1, 4)]
    finally:
        proxy.close()
        cluster.shutdown()
    # stop() ended the reused threads
    assert not any(t.is_alive() for t in proxy.supervisor._threads)


async def test_on_exhausted_fail_fails_the_next_call_with_the_cause(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 2}})
    cluster = simulated_cluster(rm, "rollout")
    proxy = LLMProxy(cluster, restart=RestartPolicy(max_restarts=0, on_exhausted="fail"))
    try:
        kill(cluster, 0)
        await proxy.model_update({}, 1)
        await events(proxy, "failed")
        with pytest.raises(RuntimeError, match=r"infer\[rank 0\] used its 0 restarts.*on_exhausted: fail"):
            await proxy.model_update({}, 2)
    finally:
        proxy.close()
        cluster.shutdown()


# ---------------------------------------------------------------------- migration of requests in flight
async def test_a_request_in_flight_moves_to_the_next_hardware_from_its_stored_state(make_rm):
    """A request preempted once (tokens under version 0 stored in the proxy), then its worker is killed:
    it goes on on the tag's next hardware type from prompt + stored tokens, keeps their logprobs and
    versions, and ends as the same continuation an undisturbed run gives."""
    rm = make_rm({"rollout": [{"hardware": "H800", "devices": 1}, {"hardware": "H20", "devices": 1}]})
    cluster = simulated_cluster(rm, "rollout", {"Count": ["H800", "H20"]}, decode_base_s=0.01)
    proxy = LLMProxy(cluster, restart=RestartPolicy(max_restarts=0))
    try:
        reference = await proxy.generate(request("ref", n=400), "Count")
        assert reference.hardware == "H800"
        task = asyncio.ensure_future(proxy.generate(request("moved", n=400), "Count"))
        assert await running_on(cluster) == 0
        await proxy.suspend()  # the proxy now holds the tokens generated so far under version 0
        await proxy.model_update({}, 1)
        await proxy.resume()
        assert await running_on(cluster) == 0
        kill(cluster, 0)
        out = await task
        assert out.hardware == "H20" and out.rank == 1 and out.finish_reason == "length"
        assert out.output_token_ids == reference.output_token_ids  # nothing lost, nothing doubled
        assert out.output_logprobs[:3] == reference.output_logprobs[:3]
        v = out.token_versions
        assert v[0] == 0 and v[-1] == 1 and v == sorted(v) and len(v) == 400
        assert cluster.fault_counts["rerouted"] == 1
    finally:
        proxy.close()
        cluster.shutdown()


async def test_a_request_waits_for_the_restart_of_the_only_worker_and_resumes_there(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 1}})
    cluster = simulated_cluster(rm, "rollout", decode_base_s=0.01)
    proxy = LLMProxy(cluster, restart=RestartPolicy(max_restarts=1, backoff_s=0.0))
    try:
        await proxy.model_update({}, 2)
        task = asyncio.ensure_future(proxy.generate(request("only", n=400), "x"))
        await running_on(cluster)
        kill(cluster, 0)
        out = await task
        assert len(out.output_token_ids) == 400 and out.token_versions == [2] * 400
        assert proxy.fault_metrics()["migrated"] == 1 and cluster.fault_counts["restarts"] == 1
    finally:
        proxy.close()
        cluster.shutdown()


# ---------------------------------------------------------------------- errors reach the driver
async def test_no_worker_left_makes_get_batch_raise_with_the_cause(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 1}})
    cluster = simulated_cluster(rm, "rollout", decode_base_s=0.01)
    proxy = LLMProxy(cluster, restart=RestartPolicy(max_restarts=0))
    groups = [[EnvManager(CountEnv(), proxy, CharCodec()) for _ in range(2)] for _ in range(2)]
    sched = RolloutScheduler(groups, RolloutConfig(num_env_groups=2, group_size=2, batch_groups=2))
    sched.start()
    try:
        await running_on(cluster)
        kill(cluster, 0)
        with pytest.raises(RolloutError, match="rollout stopped") as err:
            await asyncio.wait_for(sched.get_batch(), timeout=120)
        assert isinstance(err.value.__cause__, (WorkerDiedError, NoLiveWorkerError))
    finally:
        await sched.stop()
        proxy.close()
        cluster.shutdown()


async def test_generation_errors_fail_trajectories_then_get_batch_raises_the_last_one(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 1}})
    cls = inference_worker_class({"*": ["H20"]})
    engine = {"kind": "rollout_fixtures:RefusingEngine", "model": "-", "options": {"decode_base_s": 0.0}}
    cluster = ra.Cluster("refusing", cls, rm, pool="rollout", worker_kwargs={"engine": engine})
    proxy = LLMProxy(cluster)
    groups = [[EnvManager(CountEnv(), proxy, CharCodec()) for _ in range(2)]]
    cfg = RolloutConfig(num_env_groups=1, group_size=2, batch_groups=1, max_consecutive_failed_rounds=4)
    sched = RolloutScheduler(groups, cfg)
    sched.start()
    try:
        with pytest.raises(RolloutError, match="4 rounds in a row failed.*longer than this engine's context"):
            await asyncio.wait_for(sched.get_batch(), timeout=120)
        assert sched.counts["trajectories_failed"] >= 4
    finally:
        await sched.stop()
        cluster.shutdown()


# ---------------------------------------------------------------------- bounded bookkeeping
def test_round_ledger_keeps_a_watermark_and_a_small_set():
    ledger = RoundLedger(2)
    for r in [0, 2, 3, 1, 5]:
        assert ledger.settle(0, r)
    assert not ledger.settle(0, 2)  # never twice
    assert ledger.watermark == [4, 0] and ledger.above == [{5}, set()] and (0, 5) in ledger and (0, 4) not in ledger
    again = RoundLedger(2)
    again.load_state_dict(ledger.state_dict())
    assert again.state_dict() == ledger.state_dict()
    old = RoundLedger(2)
    old.load_state_dict(["0:0:1:v0", "0:1:0:v0", "1:3:0:v2"])  # an older checkpoint's list of ids
    assert old.watermark == [2, 0] and old.above == [set(), {3}]


async def test_scheduler_bookkeeping_stays_bounded_over_many_steps(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 1}})
    proxy = LLMProxy(simulated_cluster(rm, "rollout", decode_base_s=0.0005))
    cfg = RolloutConfig(num_env_groups=3, group_size=2, batch_groups=2, alpha=1)
    version = {"v": 0}
    groups = [
        [EnvManager(CountEnv(turns=1), proxy, CharCodec(), version_fn=lambda: version["v"]) for _ in range(2)]
        for _ in range(3)
    ]
    sched = RolloutScheduler(groups, cfg)
    sched.start()
    sizes = []
    try:
        for step in range(100):
            await asyncio.wait_for(sched.get_batch(step), timeout=60)
            version["v"] = step + 1
            await sched.set_version(step + 1)
            sizes.append((len(sched.completed_trajectories), sched.settled.size(), len(str(sched.state_dict()))))
    finally:
        await sched.stop()
    assert sched.counts["trajectories_trained"] == 100 * 2 * 2 and sched.settled.settled() >= 200
    assert max(s[0] for s in sizes) <= 2 * 3 * 2
    assert max(s[1] for s in sizes) <= 3 + (cfg.alpha + 2) * cfg.num_env_groups  # watermarks + unsettled rounds
    assert max(s[2] for s in sizes[40:]) <= 2 * max(s[2] for s in sizes[:40]) + 200  # checkpoint state too
    # the trajectory ledger: after stop every trajectory started is trained, retried or buffered
    led = sched.ledger()
    assert led["in_flight"] == 0 and led["lost"] == 0 and led["trained"] == 400 and led["trained_twice"] == 0
    assert led["started"] == led["trained"] + led["retried"] + led["failed"] + led["buffered"] > 400


# ---------------------------------------------------------------------- the whole pipeline
@pytest.mark.timeout(900)
def test_an_asynchronous_run_survives_a_killed_inference_worker_and_the_ledger_holds(ray_local, tmp_path):
    """The tiny model, alpha 1, two inference workers; at step 1 the process of rank 0 is SIGKILLed.
    The run completes its steps; the worker comes back with the served version; every trajectory
    started is accounted for once: trained, or dropped with its round (aborted, redundant, evicted as
    stale, still in the buffer at the end) and played again, or reported failed."""

    from rollart.pipelines.agentic import AgenticPipeline

    cfg = small_config(
        tmp_path,
        pools={"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 2}},
        steps=5,
        checkpoint_every=0,
        fault={"inference": {"max_restarts": 2, "backoff_s": 0}},
    )
    trained: list = []
    killed: list[int] = []

    class Killing(AgenticPipeline):
        async def on_step_end(self, step, record, trajs):
            trained.extend(trajs)
            if step == 1:
                killed.append(kill(self.infer, 0))

    pipe = Killing(cfg, progress=False)
    try:
        history = pipe.run()
        assert [h["step"] for h in history] == list(range(1, 6)) and killed
        ok = asyncio.run(
            asyncio.to_thread(
                pipe.proxy.supervisor.wait_for, lambda ev: any(e["event"] == "restarted" for e in ev), 120
            )
        )
        assert ok, pipe.proxy.supervisor.events
        metrics = ray.get([w.metrics.remote() for w in pipe.infer.workers], timeout=60)
        assert [m["weight_version"] for m in metrics] == [history[-1]["version"]] * 2  # the restarted one too
        assert pipe.infer.pids()[0] != killed[0]
        buffered = [t for g in pipe.scheduler.buffer.groups() for t in g]
        faults = pipe.proxy.fault_metrics()
    finally:
        pipe.shutdown()
    c = pipe.scheduler.counts
    assert history[-1]["faults"]["deaths"] == 1  # in metrics.jsonl
    assert faults["deaths"] == 1 and faults["restarts"] == 1 and faults["removed"] == 0
    # the ledger
    ended = (
        c["trajectories_ok"] + c["trajectories_aborted"] + c["trajectories_failed"] + c["trajectories_reward_failed"]
    )
    assert c["trajectories_started"] == ended
    assert c["trajectories_trained"] == len(trained) == 5 * cfg.rollout.batch_groups * cfg.rollout.group_size
    assert len({t.traj_id for t in trained}) == len(trained) and c["rounds_trained_twice"] == 0
    assert c["trajectories_kept"] == len(trained) + c["trajectories_evicted"] + len(buffered)
    assert all(t.status == "ok" for t in trained)
    # the staleness bound held through the restart; every token records a version no older than its start
    for h in history:
        assert h["max_staleness"] <= cfg.rollout.alpha
    for t in trained:
        assert t.min_version >= t.start_version


# ---------------------------------------------------------------------- a whole rollout host lost
@pytest.mark.timeout(900)
def test_losing_every_process_of_a_rollout_host_leaves_the_job_on_the_other_hosts(hosts3, tmp_path):
    """Host c (the only H20) is killed, raylet and all, while a request runs there: the request goes
    on on H800 (the tag's next preference), the H20 rank leaves the pool, a weight push reaches the
    rest, new requests are served on H800."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).parent / "scripts" / "fault_hosts_driver.py")
    driver = hosts3.popen(
        "head",
        [sys.executable, script, str(tmp_path / "meta.sqlite")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = driver.stdout.readline()
        assert line.startswith("READY "), line + driver.stderr.read()[-4000:]
        ready = json.loads(line[len("READY ") :])
        assert ready["hardware"] == "H20" and "10.201.0.3" in ready["ips"].values()
        assert hosts3.kill_host("c")
        driver.stdin.write("go\n")
        driver.stdin.flush()
        stdout, stderr = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        hosts3.restart_host("c")
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert driver.returncode == 0 and lines, stderr[-4000:]
    res = json.loads(lines[-1][len("RESULT ") :])
    assert res["moved"] == {"hardware": "H800", "tokens": 300}
    assert all(hw == "H800" and versions == [1] * 4 for hw, versions in res["after"])
    assert [(hw, v) for _, hw, v in res["metrics"]] == [("H800", 1)]
    assert res["faults"]["deaths"] == 1 and res["faults"]["removed"] == 1 and res["events"] == ["removed"]
