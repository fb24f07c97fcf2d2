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
    assert [p["device_ids"] for p in wide.placement()] == [[0, 1], [2, 3]]
    ref = ra.Cluster("wide_ref", Assigned, rm, pool="wide", devices_per_worker=2, colocate_with=wide)
    assert ref.assigned() == [0.0, 0.0]  # it shares its owner's bundle
    assert [p["node_id"] for p in ref.placement()] == [p["node_id"] for p in wide.placement()]
