"""Mooncake failures say what is wrong and the fix: a ``mooncake_master`` that cannot load a shared
library (exit 127) names the library and the Debian package; a client segment advertised on a loopback
address where other hosts take part fails at once with the address and the fix (the namespace-host case is
in tests/test_multihost_weights.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from rollart.weights.mooncake_channel import MooncakeStoreError, loopback_segment_problem
from rollart.weights.mooncake_master import MooncakeUnavailable, library_fix, missing_library


def test_the_loaders_message_names_the_library():
    out = "/x/mooncake_master: error while loading shared libraries: libibverbs.so.1: cannot open shared object file"
    assert missing_library(out) == "libibverbs.so.1"
    assert (
        missing_library("mooncake_master: error while loading shared libraries: /lib/x/librdmacm.so.1: file too short")
        == "librdmacm.so.1"
    )
    assert missing_library("bind: address already in use") is None
    assert "apt-get install libibverbs1" in library_fix("libibverbs.so.1")
    assert "apt-file search libfoo.so.2" in library_fix("libfoo.so.2")


def test_a_master_without_libibverbs_names_it_and_the_package(tmp_path, monkeypatch):
    """The real mooncake_master, run where libibverbs.so.1 cannot be loaded: a private mount namespace in
    which the library file is an empty file (needs root and unshare)."""
    pytest.importorskip("mooncake")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding a library in a private mount namespace needs root and unshare")
    from rollart.weights import mooncake_master as mm

    binary = mm.find_master_binary()
    linked = re.search(
        r"libibverbs\.so\.1 => (\S+)", subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
    )
    if linked is None:
        pytest.skip("this mooncake_master does not link libibverbs.so.1")
    (tmp_path / "empty").write_bytes(b"")
    wrapper = tmp_path / "mooncake_master"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'exec unshare -m sh -c \'mount --bind {tmp_path / "empty"} {linked.group(1)} && exec {binary} "$@"\' sh "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setattr(mm, "find_master_binary", lambda: str(wrapper))
    with pytest.raises(MooncakeUnavailable) as err:
        mm.MooncakeMaster().start(timeout_s=60)
    msg = str(err.value)
    assert msg.startswith("mooncake_master exited with code 127 at start: ")
    assert "libibverbs.so.1" in msg and "apt-get install libibverbs1" in msg
    assert os.path.getsize(linked.group(1)) > 0  # the machine's own library is untouched


def test_a_loopback_segment_is_refused_where_other_hosts_take_part():
    # a Ray cluster of three nodes: whatever the master's address
    msg = loopback_segment_problem("127.0.0.1", "127.0.0.1:50051", ray_nodes=3)
    assert msg is not None and "advertised on 127.0.0.1" in msg and "the Ray cluster has 3 nodes" in msg
    assert "MC_TCP_BIND_ADDRESS" in msg and "--node-ip-address" in msg
    # a master on another host (10.201.0.1 is not an address of this machine: nothing is sent to it)
    msg = loopback_segment_problem("127.0.0.1", "10.201.0.1:50051", ray_nodes=None)
    assert msg is not None and "the master is at 10.201.0.1:50051" in msg
    # one machine: loopback is right; a routable address is always right
    assert loopback_segment_problem("127.0.0.1", "127.0.0.1:50051", ray_nodes=1) is None
    assert loopback_segment_problem("127.0.0.1", "127.0.0.1:50051", ray_nodes=None) is None
    assert loopback_segment_problem("10.201.0.2", "10.201.0.1:50051", ray_nodes=3) is None


def test_the_client_refuses_it_before_joining(monkeypatch):
    pytest.importorskip("mooncake.store")
    import torch

    from rollart.weights.mooncake_channel import MooncakeChannel

    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    channel = MooncakeChannel("loop", "10.201.0.1:50051", segment_mb=8, timeout_s=1)
    with pytest.raises(MooncakeStoreError, match=r"advertised on 127\.0\.0\.1 \(MC_TCP_BIND_ADDRESS=127\.0\.0\.1\)"):
        channel.publish({"x": torch.zeros(3)}, 0)
