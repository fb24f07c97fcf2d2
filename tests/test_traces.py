"""Trajectory traces (``RUN_DIR/traces.jsonl``): a real run's trace holds every trained trajectory's life
in order and agrees with the step records and the ledger; a request whose worker is killed shows its
migration; sampling traces exactly the seed's choice; the size cap stops tracing while the ledger stays
exact; ``rollart trace`` prints a trajectory's timeline."""

import asyncio
import json
import logging
import re

import pytest
from rollout_fixtures import CharCodec, CountEnv, simulated_cluster

# imported (and assertion-rewritten) at collection, before any Ray thread runs
from test_fault_tolerance import kill, running_on
from test_pipeline import read, small_config

from rollart.cli import main
from rollart.cluster.config import RestartPolicy
from rollart.rollout.config import RolloutConfig
from rollart.rollout.env_manager import EnvManager
from rollart.rollout.llm_proxy import LLMProxy
from rollart.rollout.scheduler import RolloutScheduler
from rollart.tracking.traces import TRACES, TraceWriter, lives, read_traces, sampled

pytestmark = pytest.mark.timeout(600)


def run_pipeline(cfg, trained=None):
    from rollart.pipelines.agentic import AgenticPipeline

    class Recording(AgenticPipeline):
        async def on_step_end(self, step, record, trajs):
            if trained is not None:
                trained.extend(t.traj_id for t in trajs)

    pipe = Recording(cfg, progress=False)
    try:
        pipe.run()
    finally:
        pipe.shutdown()
    return pipe


def test_a_runs_trace_holds_every_trained_trajectorys_life_and_rollart_trace_prints_it(ray_local, tmp_path, capsys):
    # alpha 1, 4 groups of 4, 2 groups a batch
    cfg = small_config(tmp_path, steps=3, checkpoint_every=0, traces={"enabled": True})
    run_pipeline(cfg)
    run = tmp_path / "run"
    ledger = json.loads((run / "ledger.json").read_text())
    step_of_group = {g: rec["step"] for rec in read(run / "metrics.jsonl") for g in rec["groups"]}
    events = list(read_traces(run))
    assert events[0]["event"] == "trace_started" and events[0]["sample"] == 1.0
    all_lives = lives(events)
    trained = [life for life in all_lives if life.outcome == "trained"]
    assert len(trained) == ledger["trained"] == 3 * 2 * 4
    assert len({life.traj_id for life in trained}) == len(trained)
    for life in trained:
        names = [e["event"] for e in life.events]
        # created -> admitted -> reset -> (generate -> env step)+ -> reward -> buffered -> trained
        assert names[:3] == ["created", "admitted", "env_reset"], names
        assert names[-4:] == ["reward", "cost", "buffered", "trained"], names
        turns = names[3:-4]
        assert re.fullmatch(r"((generate,)+env_step,?)+", ",".join(turns)), names  # a preempted call: 2 generates
        times = [e["t"] for e in life.events]
        assert times == sorted(times)
        created, end = life.events[0], life.events[-1]
        assert (
            created["tag"] == "reverse-3" and f"{created['group']}:{created['round']}" == life.traj_id.rsplit(":", 2)[0]
        )
        # trained at the step whose record lists its group, within the asynchronous bound
        assert end["step"] == step_of_group[life.traj_id.rsplit(":", 2)[0]]
        assert 0 <= end["staleness"] <= cfg.rollout.alpha and end["reward"] is not None
        start_version = life.events[1]["start_version"]
        gens = [e for e in life.events if e["event"] == "generate"]
        for gen in gens:  # a call preempted by a weight swap may answer no token; its continuation follows
            assert gen["rank"] == 0 and gen["hardware"] == "CPU" and gen["node_ip"]
            assert all(start_version <= v <= end["version"] for v in gen["versions"])
            assert gen["prompt_tokens"] > 0 and 0 <= gen["response_tokens"] <= 3 and gen["latency_s"] >= 0
        assert 0 < sum(g["response_tokens"] for g in gens) <= 3 and any(g["versions"] for g in gens)
        step = next(e for e in life.events if e["event"] == "env_step")
        assert step["latency_s"] >= 0 and "error" not in step
        reward = life.events[-4]
        assert reward["source"] == "env" and reward["status"] == "ok" and reward["reward"] == end["reward"]
    # every other life that ended was dropped or failed, with its reason
    for life in all_lives:
        if life.outcome in ("dropped", "failed"):
            assert life.end is not None and (life.end.get("reason") or life.end.get("error"))

    # the cost ledger in the step records: the trained trajectories' charges per task and tag, as their
    # cost events in the trace sum them; the run's total in cost.json
    records = read(run / "metrics.jsonl")
    cost_of = {life.traj_id: life.cost for life in trained}
    for rec in records:
        mine = [life for life in trained if life.end["step"] == rec["step"]]
        cost = rec["cost"]
        assert cost["by_task"]["reverse-3"]["trajectories"] == len(mine) == cost["trained"]["trajectories"]
        assert cost["by_tag"].keys() == {"reverse-3"}
        for key in ("worker_s", "device_s"):
            assert cost["trained"][key].keys() == cost["busy"].keys()
            pool = next(iter(cost["busy"]))
            want = sum(cost_of[life.traj_id][key][pool] for life in mine)
            assert cost["by_task"]["reverse-3"][key][pool] == pytest.approx(want, rel=1e-3, abs=1e-5)
        assert cost["trained"]["env_s"] == pytest.approx(sum(cost_of[x.traj_id]["env_s"] for x in mine), abs=1e-4)
        assert cost["busy"][pool]["worker_s"] > 0 and cost["busy"][pool]["unattributed_worker_s"] == 0
    total = json.loads((run / "cost.json").read_text())
    assert total["trained_trajectories"] == ledger["trained"] and total["steps"] == 3
    assert total["device_s_total"] == pytest.approx(sum(r["cost"]["device_s_total"] for r in records))
    assert total["by_task"]["reverse-3"]["worker_s"][pool] == pytest.approx(
        sum(c["worker_s"][pool] for c in cost_of.values()), rel=1e-3
    )
    assert total["busy"][pool]["worker_s"] >= total["trained"]["worker_s"][pool] > 0

    # the reader: one trajectory's timeline, and the list filtered by outcome
    one = trained[0]
    assert main(["trace", str(run), one.traj_id]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{one.traj_id}  (reverse-3, trained,")
    assert [line.split()[1] for line in out.splitlines()[1:]] == [e["event"] for e in one.events]
    assert "rank=0" in out and f"step={one.events[-1]['step']}" in out
    assert main(["trace", str(run), "--status", "trained", "--tag", "reverse-3"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 1 + len(trained) and all(" trained " in r for r in rows[1:])
    assert main(["trace", str(run), "9:9:9:v9"]) == 2  # no such trajectory: a clear error
    assert main(["trace", str(run), "--cost", "--status", "trained", "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["tag"] == "reverse-3" and row["trajectories"] == len(trained) and row["uncosted"] == 0
    assert row["worker_s"] == pytest.approx(sum(c["worker_s"][pool] for c in cost_of.values()), rel=1e-6)


def test_sampling_traces_the_seeds_choice_and_the_cap_stops_tracing_with_the_ledger_exact(ray_local, tmp_path, caplog):
    trained: list[str] = []
    cfg = small_config(tmp_path, steps=3, checkpoint_every=0, traces={"enabled": True, "sample": 0.5}, seed=7)
    run_pipeline(cfg, trained)
    traced = {life.traj_id for life in lives(read_traces(tmp_path / "run")) if life.outcome == "trained"}
    chosen = {t for t in trained if sampled(t, 7, 0.5)}
    assert traced == chosen and 0 < len(chosen) < len(trained)  # exactly the seed's choice: about half

    cap_mb = 0.01  # about 10 KiB: a few trajectories' lives
    capped = small_config(tmp_path / "capped", steps=3, checkpoint_every=0, traces={"enabled": True, "max_mb": cap_mb})
    with caplog.at_level(logging.WARNING, logger="rollart.tracking.traces"):
        run_pipeline(capped)
    path = tmp_path / "capped" / "run" / TRACES
    assert 0 < path.stat().st_size <= cap_mb * 2**20
    assert [r for r in caplog.records if "traces.max_mb" in r.getMessage()] != []
    assert len([r for r in caplog.records if "traces.max_mb" in r.getMessage()]) == 1
    done = [life for life in lives(read_traces(path)) if life.outcome == "trained"]
    ledger = json.loads((tmp_path / "capped" / "run" / "ledger.json").read_text())
    assert len(done) < ledger["trained"] == 3 * 2 * 4 and ledger["lost"] == 0  # the counts do not depend on traces


class LongEnv(CountEnv):
    """One turn of 400 tokens (long enough to kill its worker mid-generation)."""

    max_new_tokens = 400

    def __init__(self):
        super().__init__(turns=1)


class NoEosCodec(CharCodec):
    eos_token_id = None


async def test_a_trajectory_whose_worker_died_mid_generation_shows_the_migration(make_rm, tmp_path):
    rm = make_rm({"rollout": [{"hardware": "H800", "devices": 1}, {"hardware": "H20", "devices": 1}]})
    cluster = simulated_cluster(rm, "rollout", {"Count": ["H800", "H20"]}, decode_base_s=0.01)
    proxy = LLMProxy(cluster, restart=RestartPolicy(max_restarts=0))
    writer = TraceWriter(tmp_path)
    sched = RolloutScheduler(
        [[EnvManager(LongEnv(), proxy, NoEosCodec())]], RolloutConfig(num_env_groups=1, group_size=1, batch_groups=1)
    )
    sched.traces = writer
    sched.start()
    try:
        assert await running_on(cluster) == 0
        kill(cluster, 0)
        groups = await asyncio.wait_for(sched.get_batch(), timeout=120)
        writer.trained(groups, step=1, version=sched.last_batch_version)
    finally:
        await sched.stop()
        proxy.close()
        cluster.shutdown()
    writer.close()
    (life,) = [x for x in lives(read_traces(tmp_path)) if x.outcome == "trained"]
    names = [e["event"] for e in life.events]
    assert names == [
        "created",
        "admitted",
        "env_reset",
        "migrate",
        "generate",
        "env_step",
        "reward",
        "cost",
        "buffered",
        "trained",
    ]
    moved, gen = life.events[3], life.events[4]
    assert (
        moved["from_rank"] == 0
        and moved["from_hardware"] == "H800"
        and moved["error"] in ("ActorDiedError", "WorkerDiedError")
    )
    assert moved["turn"] == gen["turn"] == 0
    assert gen["rank"] == 1 and gen["hardware"] == "H20" and gen["response_tokens"] == 400 - moved["tokens_kept"]
    assert cluster.fault_counts["rerouted"] == 1  # the Cluster sent the call again: one move, traced


def test_sampling_is_seeded_and_lives_split_where_an_id_is_played_again(tmp_path):
    ids = [f"{g}:{r}:{m}:v{r}" for g in range(10) for r in range(10) for m in range(8)]
    half = [t for t in ids if sampled(t, 3, 0.5)]
    assert half == [t for t in ids if sampled(t, 3, 0.5)] and 300 < len(half) < 500
    assert half != [t for t in ids if sampled(t, 4, 0.5)]  # another seed chooses others
    assert all(sampled(t, 3, 1.0) for t in ids) and not any(sampled(t, 3, 0.0) for t in ids)
    writer = TraceWriter(tmp_path, sample=0.5, seed=3)
    for t in ids:
        if writer.wants(t):
            writer.emit(t, "created", tag="x")
    writer.emit(half[0], "failed", status="failed", error="step 0: boom")
    writer.emit(half[0], "created", tag="x")  # the same round played again at the same version
    writer.close()
    got = lives(read_traces(tmp_path))
    assert [x.traj_id for x in got] == half + [half[0]]
    assert got[0].outcome == "failed" and got[-1].outcome == "open"


def test_event_values_are_written_as_json_numbers_lists_and_strings(tmp_path):
    """numpy numbers stay numbers, tuples lists, int keys strings, an unknown object its str(); each event one
    line, and the file's size is what the writer counted against the cap."""
    import numpy as np

    writer = TraceWriter(tmp_path)
    writer.emit("a", "reward", reward=np.float64(0.25), tokens=np.int64(7), versions=(1, 2), by={3: 1.5})
    writer.emit("a", "failed", error=ValueError("boom"), status="failed")
    writer.close()
    events = [e for e in read_traces(tmp_path) if e["traj_id"] == "a"]
    assert [e["event"] for e in events] == ["reward", "failed"]
    assert events[0]["reward"] == 0.25 and isinstance(events[0]["reward"], float) and events[0]["tokens"] == 7
    assert events[0]["versions"] == [1, 2] and events[0]["by"] == {"3": 1.5}
    assert events[1]["error"] == "boom"
    assert writer.written == (tmp_path / "traces.jsonl").stat().st_size


class TurnsEnv(CountEnv):
    """Two turns of 30 tokens each (a few engine steps, so a killed worker has requests in flight)."""

    max_new_tokens = 30


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-call-per-request"])
async def test_a_job_with_a_killed_worker_and_a_join_traces_every_trained_life_and_its_cost_sums_to_busy_time(
    make_rm, tmp_path, batched
):
    """The rollout side of a job (2 workers, 4 groups of 2, alpha 1, a weight version per step) loses a
    worker mid-generation and gains one through an elastic join; every trained trajectory's trace is a
    complete, ordered life that agrees with the ledger (a migrated one shows the dead worker and the one
    that finished its turn), and the workers' time charged to the traced lives sums to the pool's busy
    time measured by the proxy. Batched (the pipeline's default): a dead worker's requests fail and the
    proxy sends them again; one call per request: the Cluster reroutes the call."""
    from ray.util.placement_group import remove_placement_group
    from test_elastic import FAST, block_h20, serving, wait_until

    from rollart.rollout.elastic import ElasticRollout

    rm = make_rm({"rollout": {"hardware": "H20", "devices": 2, "max_devices": 3}})
    blocker, _ = block_h20()  # the other H20 devices are taken: the pool stays at 2 until they come free
    cluster = simulated_cluster(rm, "rollout", {"Count": ["H20"]}, decode_base_s=0.01)
    proxy = LLMProxy(cluster, restart=RestartPolicy(max_restarts=0), batch_requests=batched)  # the dead: removed
    elastic = ElasticRollout(rm, cluster, proxy, FAST, out_dir=tmp_path)
    writer = TraceWriter(tmp_path)
    sched = RolloutScheduler(
        [
            [EnvManager(TurnsEnv(), proxy, NoEosCodec(), version_fn=lambda: sched.version) for _ in range(2)]
            for _ in range(4)
        ],
        RolloutConfig(num_env_groups=4, group_size=2, batch_groups=2, alpha=1),
    )
    sched.traces = writer
    trained_ids: list[str] = []
    version = 0

    async def step() -> None:
        nonlocal version
        groups = await asyncio.wait_for(sched.get_batch(version), timeout=120)
        trajs = [t for g in groups for t in g]
        sched.audit_trained(trajs)
        trained_ids.extend(t.traj_id for t in trajs)
        writer.trained(groups, step=version + 1, version=version)
        version += 1
        await proxy.model_update({}, version)  # the new policy: requests in flight are preempted and continued
        await sched.set_version(version)
        writer.flush()

    try:
        await proxy.model_update({}, 0)
        elastic.start()
        sched.start()
        await step()
        victim = await running_on(cluster)
        kill(cluster, victim)  # mid-generation: its requests move to the other worker
        await step()
        remove_placement_group(blocker)  # devices come free: a worker joins the pool
        await asyncio.to_thread(wait_until, lambda: elastic.totals["joined"] == 1, 120, "a worker joined")
        (joined,) = [e["rank"] for e in elastic.events if e["event"] == "joined"]
        for _ in range(20):  # until the joined worker generated for a trained trajectory (bounded)
            await step()
            if any(
                e["event"] == "generate" and e["rank"] == joined and e["traj_id"] in trained_ids
                for e in read_traces(tmp_path)
            ):
                break
        assert victim not in serving(cluster) and joined in serving(cluster)
    finally:
        await sched.stop()
        elastic.stop()
        writer.close()
        busy = proxy.meter.busy()
        engines = {m["rank"]: m["engine_busy_s"] for m in await cluster.metrics()}  # the live workers' own count
        proxy.close()
        cluster.shutdown()
    ledger = sched.ledger()
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0 and sched.counts["rewards_invented"] == 0

    all_lives = lives(read_traces(tmp_path))
    by_outcome = {k: [x for x in all_lives if x.outcome == k] for k in ("trained", "failed", "dropped", "open")}
    # the trace agrees with the ledger: every trajectory started has one life, each ended where the ledger says
    assert len(all_lives) == ledger["started"]
    assert sorted(x.traj_id for x in by_outcome["trained"]) == sorted(trained_ids)
    assert len(by_outcome["trained"]) == ledger["trained"]
    assert len(by_outcome["failed"]) == ledger["failed"] == 0
    assert len(by_outcome["dropped"]) == ledger["retried"] + ledger["filtered"]
    assert len(by_outcome["open"]) == ledger["buffered"] + ledger["in_flight"]
    turn_events = "(?:(?:migrate|generate),)*generate,env_step,"
    for life in by_outcome["trained"]:
        names = ",".join(e["event"] for e in life.events)
        assert re.fullmatch(f"created,admitted,env_reset,(?:{turn_events}){{2}}reward,cost,buffered,trained", names)
        assert [e["t"] for e in life.events] == sorted(e["t"] for e in life.events), life.traj_id
        turns = [e["turn"] for e in life.events if "turn" in e]
        assert turns == sorted(turns) and set(turns) == {0, 1}
        end = life.events[-1]
        assert end["staleness"] <= 1 and end["version"] == end["step"] - 1
        for i, e in enumerate(life.events):
            if e["event"] == "migrate":  # both workers: the dead one, then the one that answered the turn
                assert e["from_rank"] == victim and e["from_hardware"] == "H20"
                answer = next(g for g in life.events[i + 1 :] if g["event"] == "generate")
                assert answer["turn"] == e["turn"] and answer["rank"] not in (victim, -1)
    # the kill is in the traces: lives with a turn on the dead worker (a trained one among them is checked
    # above; one finished after the next version can also have been evicted as stale, alpha 1)
    migrated = [x for x in all_lives if any(e["event"] == "migrate" and e["from_rank"] == victim for e in x.events)]
    assert migrated, "no traced life had a request on the killed worker"
    assert any(e["event"] == "generate" and e["rank"] == joined for x in by_outcome["trained"] for e in x.events)

    # the cost ledger: each life's episode has one cost event; the worker time charged to the lives (and
    # to nothing else: every request here belongs to a trajectory) sums to the pool's busy time
    costs = [[e for e in x.events if e["event"] == "cost"] for x in all_lives]
    assert all(len(c) == 1 for c in costs)
    charged = sum(c[0]["worker_s"].get("rollout", 0.0) for c in costs)
    assert busy["unattributed_worker_s"] == 0.0 and busy["worker_s"] > 0
    assert charged == pytest.approx(busy["worker_s"], rel=0.05)
    # one device per H20 worker: device-seconds equal worker-seconds, per life
    for (c,) in costs:
        # (a life stopped at the end while its request still waited for a worker was charged nothing)
        assert c["device_s"].keys() == c["worker_s"].keys() <= {"rollout"}
        assert c["device_s"].get("rollout", 0.0) == pytest.approx(c["worker_s"].get("rollout", 0.0), abs=1e-5)
        assert c["env_s"] >= 0 and c["reward_s"] >= 0
    assert {r for r, b in busy["by_rank"].items() if b["worker_s"] > 0} >= {victim, joined}
    # the proxy sees each request from its dispatch to its answer: at least the time the engine itself was busy
    assert all(busy["by_rank"][r]["worker_s"] >= s > 0 for r, s in engines.items())
