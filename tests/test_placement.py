"""Device choice and rendezvous interface logic of rollart.training.placement (CPU-runnable)."""

from collections import namedtuple

import pytest
import torch

from rollart.cluster.devices import worker_device, worker_devices
from rollart.resource_manager.net import free_port, interface_of

Addr = namedtuple("Addr", "family address netmask broadcast ptp")
IFACES = {
    "lo": [Addr(2, "127.0.0.1", "255.0.0.0", None, None), Addr(10, "::1", None, None, None)],
    "eth0": [Addr(17, "02:42:ac:11:00:02", None, None, None), Addr(2, "10.201.0.2", "255.255.255.0", None, None)],
    "ib0": [Addr(2, "192.168.7.9", "255.255.255.0", None, None), Addr(10, "fe80::1%ib0", None, None, None)],
}


def test_the_interface_is_the_one_carrying_the_ip_never_lo_for_a_routable_ip():
    assert interface_of("10.201.0.2", IFACES) == "eth0"
    assert interface_of("192.168.7.9", IFACES) == "ib0"
    assert interface_of("127.0.0.1", IFACES) == "lo"
    assert interface_of("fe80::1", IFACES) == "ib0"


def test_an_ip_no_interface_carries_is_an_error_naming_it():
    with pytest.raises(ValueError, match="10.9.9.9"):
        interface_of("10.9.9.9", IFACES)


def test_this_hosts_loopback_is_found():
    assert interface_of("127.0.0.1") in ("lo", "lo0")


def test_a_worker_with_gpus_uses_cuda_0_to_n_minus_1_whatever_their_physical_ids():
    # Ray sets CUDA_VISIBLE_DEVICES=5,7 for an actor given GPUs 5 and 7: they are cuda:0 and cuda:1 inside it
    assert worker_device((5, 7), cuda=True) == torch.device("cuda", 0)
    assert worker_devices((5, 7), cuda=True) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert worker_device((3,), cuda=True) == torch.device("cuda", 0)


def test_without_cuda_or_devices_the_worker_runs_on_the_cpu():
    assert worker_device((5, 7), cuda=False) == torch.device("cpu")
    assert worker_devices((), cuda=True) == [torch.device("cpu")]


def test_free_port_is_bindable_on_the_ip():
    import socket

    port = free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_bundles_and_actor_requests_follow_devices_per_worker_and_colocation():
    from rollart.resource_manager.capacity import (
        COLOCATED_GPU_SHARE,
        OWNER_GPU_SHARE,
        HardwareCapacity,
    )

    gpu = HardwareCapacity("H800", "gpu")
    assert gpu.bundle(2) == {"GPU": 2.0, "accelerator_type:H800": 0.001}
    # one-GPU bundles: the owner and its colocated workers hold fractions of the same GPU
    assert gpu.actor_resources(1) == {"num_gpus": OWNER_GPU_SHARE, "num_cpus": 0.0}
    assert gpu.actor_resources(1, colocated=True) == {"num_gpus": COLOCATED_GPU_SHARE, "num_cpus": 0.0}
    assert OWNER_GPU_SHARE + 2 * COLOCATED_GPU_SHARE <= 1.0  # trainer + reference + critic fit one GPU
    # several GPUs per worker: the owner takes them all (Ray allows no fractions above one)
    assert gpu.actor_resources(2) == {"num_gpus": 2.0, "num_cpus": 0.0}
    assert gpu.actor_resources(2, colocated=True) == {"num_cpus": 0.0}
    logical = HardwareCapacity("H20", "logical")
    assert logical.bundle(2) == {"accelerator_type:H20": 2.0}
    assert logical.actor_resources(2) == {"num_cpus": 0.0, "resources": {"accelerator_type:H20": 2.0}}
    assert HardwareCapacity("CPU", "cpu").actor_resources(3) == {"num_cpus": 3.0}


def test_the_torch_engine_gets_the_workers_device_unless_configured():
    from rollart.rollout.engine_config import build_engine

    assert str(build_engine({"kind": "torch"}, device="cpu").device) == "cpu"
    assert str(build_engine({"kind": "torch", "options": {"device": "cpu"}}, device="cuda:0").device) == "cpu"
    if not torch.cuda.is_available():  # the worker's device does reach the engine: here it cannot load there
        with pytest.raises((AssertionError, RuntimeError), match="CUDA|cuda"):
            build_engine({"kind": "torch"}, device="cuda:0")
