"""The cluster-wide registry (Ray GCS KV) mirrors the metadata store's writes."""

import ray

from rollart.resource_manager.registry import ClusterRegistry


def test_writes_are_read_back_per_job_and_ending_a_job_releases_its_rows(ray_local, tmp_path):
    reg = ClusterRegistry(namespace=f"rollart-test-{tmp_path.name}")
    reg.record_job("j1", "10.0.0.1:6379")
    reg.record_job("j10", None)  # a job id that j1 is a prefix of
    reg.record_pool("j1", "train", 0, "H800", 2, None, "rollart/j1/train/0")
    reg.record_binding("j1", "actor", 0, "train", "H800", "n0", [0], "actor:0:x", node_ip="10.0.0.2")
    reg.record_binding("j1", "actor", 1, "train", "H800", "n0", [1], "actor:1:x", node_ip="10.0.0.2")
    reg.set_binding_state("j1", "actor", 1, "dead")
    reg.record_endpoint("j1", "reward", "compute", "http://10.0.0.3:8000/r", 5.0, 2)
    snap = reg.snapshot("j1")
    assert [j["job_id"] for j in snap["jobs"]] == ["j1"]
    assert snap["jobs"][0]["driver_ip"] == ray.util.get_node_ip_address()
    assert [(b["rank"], b["node_ip"], b["state"]) for b in snap["bindings"]] == [
        (0, "10.0.0.2", "alive"),
        (1, "10.0.0.2", "dead"),
    ]
    assert snap["endpoints"][0]["url"] == "http://10.0.0.3:8000/r"
    assert {j["job_id"] for j in reg.jobs()} == {"j1", "j10"}
    reg.end_job("j1")
    snap = reg.snapshot("j1")
    assert snap["jobs"][0]["ended_at"] is not None
    assert [p["state"] for p in snap["pools"]] == ["released"]
    assert {b["state"] for b in snap["bindings"]} == {"stopped"}
    assert reg.jobs("j10")[0]["ended_at"] is None


def test_the_resource_manager_registers_its_pools_and_bindings_cluster_wide(make_rm):
    import rollart as ra

    class Probe(ra.Worker):
        @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
        def ping(self) -> int:
            return self.rank

    rm = make_rm({"reg_pool": {"hardware": "H20", "devices": 1}})
    ra.Cluster("reg_probe", Probe, rm, pool="reg_pool").shutdown()
    snap = ClusterRegistry().snapshot(rm.job_id)  # the shared test Ray: other tests' pools share the job id
    assert [(p["pool"], p["hardware"]) for p in snap["pools"] if p["pool"] == "reg_pool"] == [("reg_pool", "H20")]
    (b,) = [b for b in snap["bindings"] if b["cluster"] == "reg_probe"]
    assert (b["cluster"], b["node_ip"], b["state"]) == ("reg_probe", "127.0.0.1", "stopped")


def test_devices_per_worker_gives_each_actor_that_many_devices_of_one_bundle(make_rm):
    import rollart as ra

    class Assigned(ra.Worker):
        @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
        def assigned(self) -> float:
            return ray.get_runtime_context().get_assigned_resources().get("accelerator_type:H800", 0.0)

    rm = make_rm({"wide": {"hardware": "H800", "devices": 4}})
    wide = ra.Cluster("wide", Assigned, rm, pool="wide", devices_per_worker=2)
    assert wide.assigned() == [2.0, 2.0]
    assert [p["slot_ids"] for p in wide.placement()] == [[0, 1], [2, 3]]
    assert [p["device_ids"] for p in wide.placement()] == [[], []]  # logical devices: no GPU
    ref = ra.Cluster("wide_ref", Assigned, rm, pool="wide", devices_per_worker=2, colocate_with=wide)
    assert ref.assigned() == [0.0, 0.0]  # it shares its owner's bundle
    assert [p["node_id"] for p in ref.placement()] == [p["node_id"] for p in wide.placement()]


def test_a_job_row_is_only_ever_written_under_the_admission_lock(ray_local, tmp_path):
    """`rollart jobs` never sees a job as queued that the same lock hold admits: the row is first
    written inside the hold that makes the first admission decision (a job with no row lists as
    pending), so three jobs submitted at once show 'queued' only for the one that must wait."""
    import threading

    from rollart.resource_manager.admission import LOCK, Admission, wait_for_admission

    class Recording(ClusterRegistry):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.writes: list[tuple[str, str | None, str | None]] = []  # (job, state, lock holder)

        def update_job(self, job_id, **fields):
            held = self._get(f"locks/{LOCK}")
            self.writes.append((job_id, fields.get("state"), held and held["holder"]))
            return super().update_job(job_id, **fields)

    reg = Recording(namespace=f"rollart-test-{tmp_path.name}")
    asks = {"H800": 6.0}  # the whole local cluster's H800s: one job at a time
    assert reg.try_lock(LOCK, "another-driver")  # another driver is deciding: no row may appear meanwhile
    first = threading.Thread(
        target=wait_for_admission, args=(reg, "first", asks, {"H800": ["train"]}, Admission(poll_s=0.05))
    )
    first.start()
    assert reg.jobs("first") == []  # not yet in the queue: `rollart jobs` lists it as pending
    reg.unlock(LOCK, "another-driver")
    first.join(timeout=60)
    assert not first.is_alive()
    assert [r["state"] for r in reg.jobs("first")] == ["running"]
    assert reg.writes == [("first", "queued", "first"), ("first", "running", "first")]

    # a second job, while the first holds every H800, waits in the queue (its row written under its own
    # lock hold) and is admitted once the first ends
    second = threading.Thread(
        target=wait_for_admission, args=(reg, "second", asks, {"H800": ["train"]}, Admission(poll_s=0.05))
    )
    second.start()
    reg.end_job("first", state="finished")
    second.join(timeout=60)
    assert not second.is_alive()
    assert [w for w in reg.writes if w[0] == "second"] == [
        ("second", "queued", "second"),
        ("second", "running", "second"),
    ]
