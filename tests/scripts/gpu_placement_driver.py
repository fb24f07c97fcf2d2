"""A driver on a CPU-only machine that pretends Ray detected one H100: the local launcher then starts Ray with
``num_gpus=1`` and the ``accelerator_type:H100`` marker (Ray accepts a GPU it cannot see and hands its id
to the actor that asks for it). ``local_resources`` also declares two logical H800 devices. Prints, as
``RESULT <json>``, what every worker saw and the errors of configs that cannot fit.
"""

import json
import os

import torch

import rollart as ra
from rollart.resource_manager import launcher
from rollart.rollout.inference_worker import InferenceWorker


class Probe(ra.Worker):
    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def facts(self) -> dict:
        import ray

        from rollart.cluster.devices import worker_device

        with open("/proc/self/environ", "rb") as f:  # the environment this process was started with
            started = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        started_visible = started.get(b"CUDA_VISIBLE_DEVICES")
        return {
            "device_ids": list(self.device_ids),
            "slot_ids": list(self.slot_ids),
            "ray_gpu_ids": [int(g) for g in ray.get_gpu_ids()],
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "visible_at_start": None if started_visible is None else started_visible.decode(),
            "device_if_cuda": str(worker_device(self.device_ids, cuda=True)),  # as where torch sees a GPU
            "cuda_initialized": torch.cuda.is_initialized(),
        }


class CudaSeeingEngine(InferenceWorker):
    """An inference worker in a process where torch reports CUDA available."""

    def __init__(self, **kwargs: object) -> None:
        torch.cuda.is_available = lambda: True
        super().__init__(**kwargs)

    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def engine_device(self) -> str:
        return str(next(self.engine.model.parameters()).device)


def main() -> None:
    launcher.detect_gpus = lambda: launcher.DetectedGpus(1, "H100")  # what Ray reports on an H100 machine
    result: dict = {}
    rm = ra.ResourceManager(
        {
            "train": {"hardware": "H100", "devices": 1},
            "sim": {"hardware": "H800", "devices": 2},
            "cpu": {"hardware": "CPU", "cpus": 1},
            "serve": {"hardware": "CPU", "cpus": 1},
        },
        local_resources={"H800": 2, "CPU": 4},
    )
    result["capacity"] = {k: [v.mode, v.total] for k, v in rm.capacity.items()}
    gpu = ra.Cluster("on_gpu", Probe, rm, pool="train")
    result["gpu"] = gpu.facts()[0]
    result["logical"] = ra.Cluster("logical", Probe, rm, pool="sim").facts()
    result["cpu"] = ra.Cluster("on_cpu", Probe, rm, pool="cpu").facts()[0]
    result["cpu_engine"] = ra.Cluster("cpu_engine", CudaSeeingEngine, rm, pool="serve").engine_device()
    result["placement"] = {"train": gpu.placement()}
    rm.shutdown()
    errors = {}
    for name, pools in {
        "absent": {"x": {"hardware": "A100", "devices": 1}},
        "same_gpu_twice": {"a": {"hardware": "GPU", "devices": 1}, "b": {"hardware": "H100", "devices": 1}},
    }.items():
        try:
            ra.ResourceManager(pools).shutdown()
            errors[name] = None
        except ra.ResourceSpecError as err:
            errors[name] = str(err)
    result["errors"] = errors
    rm = ra.ResourceManager({"any": {"hardware": "GPU", "devices": 1}})
    result["any_gpu"] = ra.Cluster("any_gpu", Probe, rm, pool="any").facts()[0]
    rm.shutdown()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
