"""Addresses on a host: this process's node IP, a free port on it, and the interface that carries an IP.

Nothing in rollart assumes two processes share a loopback: a rank or channel that listens takes its Ray
node's IP (the address other hosts reach it on) and a port free there, and gloo, NCCL and the Mooncake
transfer engine use the interface that carries that IP. On a one-machine Ray started on 127.0.0.1 that
is ``lo``; on a cluster it is the host's own link.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any


def node_ip() -> str:
    """This process's node IP as Ray knows it (``127.0.0.1`` for a local Ray, or without Ray)."""
    import ray

    if not ray.is_initialized():
        return "127.0.0.1"
    return str(ray.util.get_node_ip_address())


def free_port(ip: str = "127.0.0.1") -> int:
    """A TCP port free on ``ip`` right now (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


def interface_of(ip: str, addresses: dict[str, list[Any]] | None = None) -> str:
    """The name of the network interface that carries ``ip`` (``lo`` for a loopback IP on a usual host).
    ``addresses`` is ``psutil.net_if_addrs()``'s shape, for tests."""
    if addresses is None:
        import psutil

        addresses = psutil.net_if_addrs()
    want = ipaddress.ip_address(ip)
    for name, addrs in addresses.items():
        for a in addrs:
            try:
                if ipaddress.ip_address(str(a.address).split("%")[0]) == want:
                    return name
            except ValueError:
                continue  # a MAC address
    if want.is_loopback:
        return "lo"
    raise ValueError(
        f"no interface of this host carries {ip} (interfaces: {sorted(addresses)}); "
        "the node IP Ray reports must be an address of this host"
    )
