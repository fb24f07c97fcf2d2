"""Placement honesty and GPU detection on a CPU-only machine (CI has no GPU).

A worker's CUDA devices are the GPUs Ray assigned it and nothing else: a worker of a CPU pool or of
logical devices runs on the CPU with CUDA hidden from its process, even where torch would see a GPU.
The local launcher declares the GPUs Ray detects; here the detection is patched to report one H100 and
Ray is started with ``num_gpus=1`` (it accepts a GPU it cannot see and hands its id to the actor).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

import rollart as ra
from rollart.resource_manager import capacity, launcher
from rollart.resource_manager.launcher import DetectedGpus, local_ray_resources

DRIVER = Path(__file__).parent / "scripts" / "gpu_placement_driver.py"


@pytest.fixture(scope="module")
def declared_gpu(tmp_path_factory):
    """What every worker of the driver (one declared H100, two logical H800, CPU pools) saw."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["ROLLART_METADATA_DB"] = str(tmp_path_factory.mktemp("meta") / "m.sqlite")
    proc = subprocess.run(
        [sys.executable, str(DRIVER)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.timeout(300)
def test_a_workers_gpu_is_the_one_ray_assigned(declared_gpu):
    gpu = declared_gpu["gpu"]
    assert gpu["ray_gpu_ids"] == [0] and gpu["device_ids"] == [0] and gpu["visible"] == "0"
    assert gpu["device_if_cuda"] == "cuda:0"
    assert declared_gpu["placement"]["train"][0]["device_ids"] == [0]
    # hardware: GPU takes the same GPU, whatever its type
    assert declared_gpu["any_gpu"]["device_ids"] == [0] and declared_gpu["any_gpu"]["device_if_cuda"] == "cuda:0"


@pytest.mark.timeout(300)
def test_cpu_and_logical_workers_never_select_cuda_and_have_it_hidden(declared_gpu):
    for facts in [declared_gpu["cpu"], *declared_gpu["logical"]]:
        assert facts["ray_gpu_ids"] == [] and facts["device_ids"] == []
        assert facts["device_if_cuda"] == "cpu"  # even where torch sees a GPU
        # hidden from the start of the process, before any import could initialise CUDA
        assert facts["visible_at_start"] == "" and facts["visible"] == ""
        assert facts["cuda_initialized"] is False
    assert [f["slot_ids"] for f in declared_gpu["logical"]] == [[0], [1]]  # slots stay visible as slots
    assert declared_gpu["cpu_engine"] == ["cpu"]  # an inference worker in a CPU pool, torch seeing CUDA


@pytest.mark.timeout(300)
def test_the_launcher_declares_the_detected_gpu_beside_logical_devices(declared_gpu):
    assert declared_gpu["capacity"] == {
        "CPU": ["cpu", 4.0],
        "GPU": ["gpu", 1.0],
        "H100": ["gpu", 1.0],
        "H800": ["logical", 2.0],
    }
    errors = declared_gpu["errors"]
    assert "pools.x.hardware: 'A100' is not in the Ray cluster (it has CPU, GPU, H100, H800)" in errors["absent"]
    assert "ask for 2 GPUs (GPU: 1, H100: 1) but the cluster has 1 free of 1" in errors["same_gpu_twice"]


def _started_with(monkeypatch, gpus: DetectedGpus, local_resources=None, asked=None) -> dict:
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(launcher, "detect_gpus", lambda: gpus)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    launcher.ensure_ray(local_resources, job_id="j", asked=asked)
    (kw,) = calls
    return kw


def test_a_gpu_machine_declares_its_gpus_and_not_the_hardware_it_lacks(monkeypatch):
    kw = _started_with(monkeypatch, DetectedGpus(2, "H100"), asked={"H100": 1, "H800": 2, "CPU": 1})
    assert kw["num_gpus"] == 2
    assert kw["resources"] == {"accelerator_type:H100": 1.0}  # H800 is left for the ResourceManager to refuse


def test_a_cpu_machine_declares_what_the_pools_ask_as_logical_devices(monkeypatch):
    kw = _started_with(monkeypatch, DetectedGpus(), asked={"H800": 2, "GPU": 1})
    assert kw["num_gpus"] == 0
    assert kw["resources"] == {
        "accelerator_type:H800": 2.0,
        "rollart_logical:H800": 1.0,
        "accelerator_type:GPU": 1.0,
        "rollart_logical:GPU": 1.0,
    }


def test_local_resources_declare_logical_devices_on_a_gpu_machine_too():
    custom, logical = local_ray_resources({"H800": 4, "H100": 8, "GPU": 2}, DetectedGpus(1, "H100"), True)
    assert logical == {"H800": 4.0}  # H100 and GPU are the machine's GPU, never logical
    assert custom == {"accelerator_type:H100": 1.0, "accelerator_type:H800": 4.0, "rollart_logical:H800": 1.0}


def test_a_logical_type_on_a_gpu_node_is_read_as_logical(monkeypatch):
    node = {
        "Alive": True,
        "NodeID": "n1",
        "Resources": {
            "CPU": 8.0,
            "GPU": 2.0,
            "accelerator_type:H100": 1.0,
            "accelerator_type:H800": 4.0,
            "rollart_logical:H800": 1.0,
        },
    }
    monkeypatch.setattr(ray, "nodes", lambda: [node])
    monkeypatch.setattr(ray._private.state, "available_resources_per_node", lambda: {"n1": node["Resources"]})
    caps = capacity.read_capacity()
    assert {k: (c.mode, c.total) for k, c in caps.items()} == {
        "CPU": ("cpu", 8.0),
        "GPU": ("gpu", 2.0),
        "H100": ("gpu", 2.0),
        "H800": ("logical", 4.0),
    }
    assert caps["GPU"].bundle() == {"GPU": 1.0}
    assert caps["H100"].bundle() == {"GPU": 1.0, "accelerator_type:H100": 0.001}
    assert caps["H800"].bundle(2) == {"accelerator_type:H800": 2.0}


def test_detection_reads_rays_accelerator_manager(monkeypatch):
    from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager as Nvidia

    monkeypatch.setattr(Nvidia, "get_current_node_num_accelerators", staticmethod(lambda: 4))
    monkeypatch.setattr(Nvidia, "get_current_node_accelerator_type", staticmethod(lambda: "H100"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")  # Ray caps the count at the visible devices
    assert launcher.detect_gpus() == DetectedGpus(2, "H100")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert launcher.detect_gpus() == DetectedGpus(0, None)
    assert Nvidia._gpu_name_to_accelerator_type("NVIDIA H100 80GB HBM3") == "H100"  # Ray's naming


def test_rollart_status_says_what_a_local_run_would_declare(monkeypatch, tmp_path, capsys):
    from rollart.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(launcher, "detect_gpus", lambda: DetectedGpus(8, "H100"))
    assert main(["status", "--json", "--store", str(tmp_path / "m.sqlite")]) == 0
    assert json.loads(capsys.readouterr().out)["gpus"] == {
        "count": 8,
        "accelerator_type": "H100",
        "detected": "8 x H100",
    }
    assert main(["status", "--store", str(tmp_path / "m.sqlite")]) == 0
    assert "GPUs on this machine (Ray's detection, declared by a local run): 8 x H100" in capsys.readouterr().out


class StartEnv(ra.Worker):
    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def visible_at_start(self) -> str | None:
        with open("/proc/self/environ", "rb") as f:
            started = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        value = started.get(b"CUDA_VISIBLE_DEVICES")
        return None if value is None else value.decode()


@pytest.mark.timeout(300)
def test_a_cpu_worker_starts_with_cuda_hidden_from_its_actors_environment(make_rm, monkeypatch):
    """Hidden from the start of its process (before any import can initialise CUDA), on any Ray. A local
    Ray that rollart started on a machine without GPUs hides them from every worker of the node (so actors
    take the workers the raylet started ahead); elsewhere the Cluster sets it in the actor's runtime
    environment. (Not in the job's on a Ray with GPUs: Ray then maps every worker's GPU ids through that
    empty list and a GPU actor would see none.)"""
    assert launcher.workers_see_no_gpu(), "the tests' local Ray has no GPU: rollart hides CUDA node-wide"
    rm = make_rm({"start_env": {"hardware": "CPU", "cpus": 1}})
    c = ra.Cluster("start_env", StartEnv, rm, pool="start_env")
    assert "runtime_env" not in c.actors.options(c._slots[0])
    assert c.visible_at_start() == [""]
    c.shutdown()
    # a Ray rollart did not start (joined, or the user's): the actor's own runtime env hides them
    monkeypatch.setattr(launcher, "_workers_see_no_gpu", False)
    c = ra.Cluster("start_env2", StartEnv, rm, pool="start_env")
    assert c.actors.options(c._slots[0])["runtime_env"] == {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
    assert c.visible_at_start() == [""]
