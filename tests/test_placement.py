"""Device choice and rendezvous interface logic of rollart.training.placement (CPU-runnable)."""

from collections import namedtuple

import pytest
import torch

from rollart.training.placement import (
    free_port,
    interface_of,
    worker_device,
    worker_devices,
)

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
    with pytest.raises(RuntimeError, match="10.9.9.9"):
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
