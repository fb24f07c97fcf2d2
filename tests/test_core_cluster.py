"""Cluster on a real local Ray: dispatch modes, async workers, tag routing with fallback, dead workers,
restarts, colocation, and validation that fails before any actor exists."""

import asyncio
import os

import pytest
import ray
import torch
from ray_helpers import kill_and_wait

import rollart as ra
from rollart.cluster.errors import NoLiveWorkerError

pytestmark = pytest.mark.timeout(300)


class Trainer(ra.Worker):
    def __init__(self, scale: float = 1.0):
        self.scale = scale

    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def whoami(self, suffix: str) -> tuple:
        return (
            self.rank,
            self.world_size,
            self.hardware,
            list(self.slot_ids),
            self.pool,
            suffix,
            list(self.device_ids),
        )

    @ra.register(dispatch=ra.Dispatch.ALL_TO_ALL)
    def add(self, x: int, y: int) -> int:
        return x + y + 100 * self.rank

    @ra.register(dispatch=ra.Dispatch.DP_SPLIT)
    def double(self, batch: ra.Batch) -> ra.Batch:
        return ra.Batch({"x": batch["x"] * 2 * self.scale, "rank": [self.rank] * len(batch)})

    @ra.register(dispatch=ra.Dispatch.DP_SPLIT)
    def stats(self, batch: ra.Batch) -> dict:
        return {"rows": len(batch)}

    @ra.register(dispatch=ra.Dispatch.RANK_ZERO)
    def leader(self) -> int:
        return self.rank

    @ra.register(dispatch=(lambda n, a, k: [((r * 10,), {}) for r in range(n)], lambda rs: sum(rs)))
    def custom(self, x: int) -> int:
        return x

    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL, by_ref=True)
    def filled(self, n: int) -> torch.Tensor:
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        return torch.full((n,), float(self.rank))

    def not_exposed(self) -> None:
        return None


@ray.remote(num_cpus=0)
class Barrier:
    """Answers nobody until ``n`` callers have arrived: every call stays in flight meanwhile."""

    def __init__(self, n: int):
        self.n, self.count, self.all_here = n, 0, asyncio.Event()

    async def arrive(self) -> int:
        self.count += 1
        if self.count >= self.n:
            self.all_here.set()
        await asyncio.wait_for(self.all_here.wait(), timeout=60)
        return self.count


class Gen(ra.Worker):
    def __init__(self):
        self.arrived = 0
        self.both_here = asyncio.Event()

    @ra.hw_mapping({"FrozenLake": ["H800", "H20"], "*": ["H20", "H800"]})
    async def generate(self, request: dict, tag_name: str) -> dict:
        return {"hardware": self.hardware, "rank": self.rank, "echo": request["i"]}

    @ra.hw_mapping({"*": ["H20", "H800"]})
    async def held(self, barrier, tag_name: str) -> int:
        await barrier.arrive.remote()
        return self.rank

    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    async def rendezvous(self) -> int:
        # completes only if two calls run concurrently on the same actor
        self.arrived += 1
        if self.arrived >= 2:
            self.both_here.set()
        await asyncio.wait_for(self.both_here.wait(), timeout=30)
        return self.arrived


def test_dispatch_modes(make_rm):
    rm = make_rm({"train": {"hardware": "H800", "devices": 3}})
    c = ra.Cluster("trainer", Trainer, rm, pool="train", worker_kwargs={"scale": 1.0})
    assert c.world_size == 3
    # logical devices are slots of the pool, never CUDA devices
    assert c.whoami("s") == [(r, 3, "H800", [r], "train", "s", []) for r in range(3)]
    assert c.add([1, 2, 3], y=[10, 20, 30]) == [11, 122, 233]
    assert c.leader() == 0
    assert c.custom(0) == 0 + 10 + 20
    fut = c.whoami("later", blocking=False)
    assert isinstance(fut, ra.ClusterFuture) and fut.result(timeout=60)[2][5] == "later"
    with pytest.raises(AttributeError, match="exposed methods are"):
        c.not_exposed()


def test_uneven_dp_split_concatenates_in_rank_order_without_padding(make_rm):
    rm = make_rm({"train": {"hardware": "H800", "devices": 3}})
    c = ra.Cluster("trainer", Trainer, rm, pool="train")
    out = c.double(ra.Batch({"x": torch.arange(7.0)}))
    assert out["x"].tolist() == [2.0 * i for i in range(7)]
    assert out["rank"] == [0, 0, 0, 1, 1, 2, 2]
    assert c.stats(ra.Batch({"x": torch.arange(2.0)})) == {"rows": [1, 1]}  # rank 2 had no rows: not called


async def test_async_methods_run_concurrently_and_routes_by_tag(make_rm):
    rm = make_rm({"rollout": [{"hardware": "H800", "devices": 2}, {"hardware": "H20", "devices": 2}]})
    g = ra.Cluster("gen", Gen, rm, pool="rollout")
    futs = [g.rendezvous(), g.rendezvous()]
    results = await asyncio.gather(*futs)
    assert all(r == [2, 2, 2, 2] for r in results)

    outs = await asyncio.gather(*[g.generate({"i": i}, tag_name="FrozenLake") for i in range(8)])
    assert {o["hardware"] for o in outs} == {"H800"} and [o["echo"] for o in outs] == list(range(8))
    other = await g.generate({"i": 0}, tag_name="Sokoban")
    assert other["hardware"] == "H20"
    with pytest.raises(LookupError):
        Gen_only_frozen = ra.hw_mapping({"FrozenLake": ["H800"]})(lambda self, r, tag_name: None)
        Gen_only_frozen.__rollart_hw_mapping__.preference("Sokoban")


async def test_least_loaded_worker_within_a_hardware_type(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 3}})
    g = ra.Cluster("gen", Gen, rm, pool="rollout")
    barrier = Barrier.remote(9)  # no call finishes before all nine are routed
    ranks = await asyncio.gather(*[g.held(barrier, tag_name="x") for _ in range(9)])
    assert sorted(ranks) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


async def test_routing_falls_back_to_h20_when_h800_workers_are_killed(make_rm):
    rm = make_rm({"rollout": [{"hardware": "H800", "devices": 2}, {"hardware": "H20", "devices": 2}]})
    g = ra.Cluster("gen", Gen, rm, pool="rollout")
    assert (await g.generate({"i": 0}, tag_name="FrozenLake"))["hardware"] == "H800"
    for rank in (0, 1):
        assert g.hardware_of(rank) == "H800"
        kill_and_wait(g.workers[rank])
    outs = await asyncio.gather(*[g.generate({"i": i}, tag_name="FrozenLake") for i in range(4)])
    assert {o["hardware"] for o in outs} == {"H20"} and [o["echo"] for o in outs] == [0, 1, 2, 3]
    assert [p["alive"] for p in g.placement()] == [False, False, True, True]
    g.restart_worker(0)
    assert (await g.generate({"i": 9}, tag_name="FrozenLake")) == {"hardware": "H800", "rank": 0, "echo": 9}
    for rank in (0, 2, 3):
        kill_and_wait(g.workers[rank])
    g.health_check()
    with pytest.raises(NoLiveWorkerError, match="no live worker"):
        await g.generate({"i": 0}, tag_name="FrozenLake")


def test_dead_worker_error_names_cluster_rank_and_hardware_and_restart(make_rm):
    rm = make_rm({"train": {"hardware": "H20", "devices": 2}})
    c = ra.Cluster("trainer", Trainer, rm, pool="train")
    old = c.pid()
    kill_and_wait(c.workers[1])
    with pytest.raises(ra.WorkerDiedError, match=r"trainer\[rank 1\] on H20 died") as info:
        c.whoami("x")
    assert (info.value.cluster, info.value.rank, info.value.hardware) == ("trainer", 1, "H20")
    c.restart_worker(1)
    new = c.pid()
    assert new[0] == old[0] and new[1] != old[1]
    assert c.whoami("y")[1] == (1, 2, "H20", [1], "train", "y", [])


def test_colocation_shares_a_pool_only_when_asked(make_rm):
    rm = make_rm({"train": {"hardware": "H800", "devices": 2}})
    a = ra.Cluster("actor", Trainer, rm, pool="train")
    with pytest.raises(ra.ResourceSpecError, match="already hosts cluster 'actor'; pass colocate_with"):
        ra.Cluster("ref", Trainer, rm, pool="train")
    b = ra.Cluster("ref", Trainer, rm, pool="train", colocate_with=a)
    pa, pb = a.placement(), b.placement()
    assert [(p["node_id"], p["slot_ids"]) for p in pa] == [(p["node_id"], p["slot_ids"]) for p in pb]
    assert b.whoami("c")[1][3] == [1]


def _actors() -> set:
    return {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}


def _placement_groups() -> set:
    return set(ray.util.placement_group_table())


def _nothing_new(actors: set, pgs: set) -> bool:
    """No actor or placement group appeared (ones of earlier tests may still be going away)."""
    return _actors() <= actors and _placement_groups() <= pgs


@pytest.mark.parametrize(
    "pools, message",
    [
        ({"train": {"hardware": "H100", "devices": 1}}, r"pools\.train\.hardware: 'H100' is not in the Ray cluster"),
        ({"train": {"hardware": "H800", "devices": 99}}, r"ask for 99 H800 devices but the cluster has"),
        (
            {"a": {"hardware": "H20", "devices": 4}, "b": {"hardware": "H20", "devices": 4}},
            r"\['a', 'b'\] ask for 8 H20",
        ),
        ({"train": {"hardware": "H800"}}, r"pools\.train: hardware 'H800' needs \"devices\""),
        (
            {"train": {"hardware": "H800", "devices": 0}},
            r'pools\.train: "devices": 0 needs "max_devices" \(an elastic group',
        ),
        ({"env": {"hardware": "CPU", "devices": 2}}, r"pools\.env: a CPU group takes \"cpus\""),
        (
            {"r": [{"hardware": "H800", "devices": 1}, {"hardware": "H20", "devcies": 1}]},
            r"pools\.r\[1\]\.devcies: Extra inputs",
        ),
    ],
)
def test_resource_errors_are_raised_before_anything_is_created(ray_local, store_path, pools, message):
    actors, pgs = _actors(), _placement_groups()
    with pytest.raises(ra.ResourceSpecError, match=message):
        ra.ResourceManager(pools, store=store_path)
    assert _nothing_new(actors, pgs)


def test_cluster_errors_are_raised_before_any_actor(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 3}, "only800": {"hardware": "H800", "devices": 1}})
    actors, pgs = _actors(), _placement_groups()
    with pytest.raises(
        ra.ResourceSpecError,
        match=r"pools\.rollout\[0\]\.devices: 3 H20 devices cannot be split .*devices_per_worker=2",
    ):
        ra.Cluster("gen", Gen, rm, pool="rollout", devices_per_worker=2)

    class Frozen(ra.Worker):
        @ra.hw_mapping({"FrozenLake": ["H20"]})
        async def generate(self, request: dict, tag_name: str) -> dict:
            return {}

    with pytest.raises(
        ra.ResourceSpecError, match=r"tag 'FrozenLake' prefers \['H20'\] but pool 'only800' has only \['H800'\]"
    ):
        ra.Cluster("gen", Frozen, rm, pool="only800")
    with pytest.raises(ra.ResourceSpecError, match="need a pool"):
        ra.Cluster("gen", Gen, rm, pool=None)
    with pytest.raises(ra.ResourceSpecError, match="pool='nope' is not a pool"):
        ra.Cluster("gen", Gen, rm, pool="nope")
    assert _nothing_new(actors, pgs)


def test_object_refs_and_large_arguments_reach_every_rank(make_rm):
    rm = make_rm({"train": {"hardware": "H800", "devices": 2}})
    c = ra.Cluster("trainer", Trainer, rm, pool="train")
    ref = ray.put("from the object store")
    assert [r[5] for r in c.whoami(ref)] == ["from the object store"] * 2  # a top-level ref is resolved
    big = "x" * 100_000
    assert [len(r[5]) for r in c.whoami(big)] == [100_000, 100_000]


def test_by_ref_results_are_owned_by_the_caller_and_outlive_their_worker(make_rm):
    """``@register(by_ref=True)``: each rank's result comes back as an ObjectRef (never copied into the
    caller) that the caller owns, so it stays readable after the worker that made it died; errors and
    dead workers fail the call like any other; the method itself is unchanged in-process."""
    from rollart.cluster.worker import WorkerContext, host_class

    rm = make_rm({"train": {"hardware": "H800", "devices": 2}})
    c = ra.Cluster("trainer", Trainer, rm, pool="train")
    refs = c.filled(60_000)  # 240 KB each: stored in the object store, not inline
    assert len(refs) == 2 and all(isinstance(r, ray.ObjectRef) for r in refs)
    fut = c.filled(3, blocking=False)
    assert [ray.get(r).tolist() for r in asyncio.run(_awaited(fut))] == [[0.0] * 3, [1.0] * 3]
    with pytest.raises(ValueError, match="n=-1 must be >= 0"):
        c.filled(-1)
    kill_and_wait(c.workers[1])
    assert torch.equal(ray.get(refs[1], timeout=60), torch.full((60_000,), 1.0))  # outlives rank 1
    with pytest.raises(ra.WorkerDiedError, match=r"trainer\[rank 1\] on H800 died"):
        c.filled(1)
    ctx = WorkerContext(cluster="local", job_id="t", rank=0, world_size=1, pool=None, hardware="CPU")
    assert torch.equal(host_class(Trainer)(ctx, (), {}).filled(2), torch.zeros(2))
    with pytest.raises(TypeError, match="by_ref takes a plain def method"):

        class AsyncByRef(ra.Worker):
            @ra.register(by_ref=True)
            async def f(self) -> int:
                return 1


async def _awaited(fut):
    return await fut


class WithBlocking(ra.Worker):
    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def step(self, blocking: bool = False) -> bool:
        return blocking


class Impostor:
    def leader(self) -> int:
        return -1


def test_a_worker_parameter_named_blocking_is_reported(caplog):
    from rollart.cluster.methods import exposed_methods

    with caplog.at_level("WARNING", logger="rollart.cluster.methods"):
        exposed_methods(WithBlocking)
    assert any("WithBlocking.step" in r.getMessage() and "'blocking'" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="rollart.cluster.methods"):
        exposed_methods(Trainer)
    assert not caplog.records


async def test_typed_call_and_call_async_match_the_attribute_style(make_rm):
    rm = make_rm({"train": {"hardware": "H800", "devices": 2}, "rollout": {"hardware": "H20", "devices": 1}})
    c = ra.Cluster("trainer", Trainer, rm, pool="train")
    assert c.call(Trainer.whoami, "s") == c.whoami("s")
    assert c.call(Trainer.add, [1, 2], y=[10, 20]) == [11, 122]
    assert c.call(Trainer.leader) == 0
    fut = c.call_async(Trainer.whoami, "later")
    assert isinstance(fut, ra.ClusterFuture) and (await fut)[1][5] == "later"
    assert c.call_async(Trainer.leader).result(timeout=60) == 0
    with pytest.raises(TypeError, match="not an exposed method"):
        c.call(Trainer.not_exposed)
    with pytest.raises(TypeError, match="not a method of Trainer"):
        c.call(Impostor.leader)  # the same name on an unrelated class
    with pytest.raises(TypeError, match="blocking"):
        c.call(Trainer.leader, blocking=False)  # type: ignore[call-arg]
    g = ra.Cluster("gen", Gen, rm, pool="rollout")
    out = await g.call_async(Gen.generate, {"i": 3}, tag_name="Sokoban")
    assert out == {"hardware": "H20", "rank": 0, "echo": 3}
    routed = g.call(Gen.generate, {"i": 4}, tag_name="FrozenLake")  # an async method: awaitable as with g.generate
    assert isinstance(routed, ra.ClusterFuture) and (await routed)["echo"] == 4
