"""Which address and interface a weight channel uses on this host.

A channel never assumes loopback: each process takes its Ray node's IP (the address other hosts
reach it on) and the interface that carries that IP (for gloo devices, ``NCCL_SOCKET_IFNAME`` and the
Mooncake transfer engine). On a one-machine Ray started on 127.0.0.1 that is ``lo``; on a cluster it
is the host's own link.
"""

from __future__ import annotations

import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface


def node_ip() -> str:
    """This process's Ray node IP (127.0.0.1 outside Ray)."""
    import ray

    return str(ray.util.get_node_ip_address()) if ray.is_initialized() else "127.0.0.1"


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:  # the interface has no IPv4 address
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(ip: str) -> str:
    """The name of the local interface that carries ``ip``; ValueError naming the known ones if none."""
    if ip.startswith("127."):
        return "lo"
    seen = {}
    for _, name in socket.if_nameindex():
        addr = _ipv4_of(name)
        seen[name] = addr
        if addr == ip:
            return name
    raise ValueError(f"no interface of this host carries {ip} (interfaces: {seen}); is this the node's IP?")
