"""GPU placement by Ray's semantics, on a machine with CUDA GPUs (marker ``gpu``; skipped without CUDA).

Inside an actor Ray sets ``CUDA_VISIBLE_DEVICES`` to the actor's GPUs: the worker's devices are
``cuda:0..n-1``; ``devices_per_worker=2`` gives an actor two GPUs; a colocated worker shares its
owner's GPU (a fractional GPU of the same bundle); the torch inference engine runs on that device.
A worker of a CPU pool sees no GPU at all; ``hardware: GPU`` takes a GPU of any type; Ray's detection
finds the machine's GPUs (what ``rollart run`` declares).
"""

import os

import pytest
import torch

import rollart as ra

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Ray's GPU resource)"),
    pytest.mark.timeout(600),
]


class GpuProbe(ra.Worker):
    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def facts(self) -> dict:
        import ray

        from rollart.cluster.devices import worker_device

        dev = worker_device(self.device_ids)
        x = torch.ones(4, device=dev) * 2  # the device exists in this process
        return {
            "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "count": torch.cuda.device_count(),
            "device": str(dev),
            "sum": float(x.sum()),
            "uuid": str(torch.cuda.get_device_properties(dev).uuid),
        }


@pytest.fixture(scope="module")
def gpu_ray():
    import ray

    n = torch.cuda.device_count()
    ray.init(
        address="local",
        num_gpus=n,
        num_cpus=4,
        resources={"accelerator_type:GPUX": 1},
        include_dashboard=False,
        namespace="rollart-gpu-tests",
    )
    yield n
    ray.shutdown()


def test_every_rank_uses_cuda_0_of_its_own_gpu(gpu_ray, tmp_path):
    rm = ra.ResourceManager({"p": {"hardware": "GPUX", "devices": gpu_ray}}, store=tmp_path / "m.sqlite")
    try:
        facts = ra.Cluster("gpu_probe", GpuProbe, rm, pool="p").facts()
        for f in facts:
            assert f["device"] == "cuda:0" and f["count"] == 1 and f["sum"] == 8.0
            assert f["visible"] == str(f["gpu_ids"][0])
        assert len({f["uuid"] for f in facts}) == gpu_ray  # each rank its own GPU
    finally:
        rm.shutdown()


def test_a_colocated_worker_shares_its_owners_gpu(gpu_ray, tmp_path):
    rm = ra.ResourceManager({"p": {"hardware": "GPUX", "devices": 1}}, store=tmp_path / "m.sqlite")
    try:
        owner = ra.Cluster("owner", GpuProbe, rm, pool="p")
        ref = ra.Cluster("ref", GpuProbe, rm, pool="p", colocate_with=owner)
        critic = ra.Cluster("critic", GpuProbe, rm, pool="p", colocate_with=owner)
        o, r, c = owner.facts()[0], ref.facts()[0], critic.facts()[0]
        assert o["gpu_ids"] == r["gpu_ids"] == c["gpu_ids"] and o["uuid"] == r["uuid"] == c["uuid"]
    finally:
        rm.shutdown()


def test_devices_per_worker_two_gives_the_actor_two_gpus(gpu_ray, tmp_path):
    if gpu_ray < 2:
        pytest.skip("needs two GPUs")
    rm = ra.ResourceManager({"p": {"hardware": "GPUX", "devices": 2}}, store=tmp_path / "m.sqlite")
    try:
        (f,) = ra.Cluster("two", GpuProbe, rm, pool="p", devices_per_worker=2).facts()
        assert len(f["gpu_ids"]) == 2 and f["count"] == 2 and f["device"] == "cuda:0"
    finally:
        rm.shutdown()


class CpuProbe(ra.Worker):
    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def facts(self) -> dict:
        from rollart.cluster.devices import worker_device

        return {
            "device": str(worker_device(self.device_ids)),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda": torch.cuda.is_available(),
            "count": torch.cuda.device_count(),
        }


def test_a_cpu_pool_worker_sees_no_gpu_and_gpu_takes_any_type(gpu_ray, tmp_path):
    pools = {"g": {"hardware": "GPU", "devices": 1}, "c": {"hardware": "CPU", "cpus": 1}}
    rm = ra.ResourceManager(pools, store=tmp_path / "m.sqlite")
    try:
        (g,) = ra.Cluster("any_gpu", GpuProbe, rm, pool="g").facts()
        assert g["device"] == "cuda:0" and g["count"] == 1 and g["sum"] == 8.0
        (c,) = ra.Cluster("cpu_worker", CpuProbe, rm, pool="c").facts()
        assert c == {"device": "cpu", "visible": "", "cuda": False, "count": 0}
    finally:
        rm.shutdown()


def test_ray_detects_this_machines_gpus():
    from rollart.resource_manager.launcher import detect_gpus

    found = detect_gpus()
    assert found.count == torch.cuda.device_count() and found.accelerator_type, found


def test_the_torch_engine_runs_on_its_workers_gpu(gpu_ray, tmp_path):
    from rollart.rollout.inference_worker import InferenceWorker

    class Engine(InferenceWorker):
        @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
        def engine_device(self) -> str:
            return str(next(self.engine.model.parameters()).device)

    rm = ra.ResourceManager({"p": {"hardware": "GPUX", "devices": 1}}, store=tmp_path / "m.sqlite")
    try:
        assert ra.Cluster("eng", Engine, rm, pool="p").engine_device() == ["cuda:0"]
    finally:
        rm.shutdown()
