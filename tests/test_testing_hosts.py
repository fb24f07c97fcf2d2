"""The namespace-host harness itself: isolation, hardware declared per host, teardown."""

import os
import subprocess

import pytest

from rollart.testing import HostsError, HostSpec, skip_reason, start_hosts

NODES = (
    "import json, ray\n"
    "ray.init(log_to_driver=False)\n"
    "print('RESULT ' + json.dumps({n['NodeManagerAddress']: {k: v for k, v in n['Resources'].items()\n"
    "      if k.startswith('accelerator_type:')} for n in ray.nodes() if n['Alive']}))\n"
)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_every_host_is_a_node_with_its_hardware_and_sees_the_cluster_from_any_host(hosts3):
    want = {
        "10.201.0.1": {"accelerator_type:H800": 2.0},
        "10.201.0.2": {"accelerator_type:H800": 2.0},
        "10.201.0.3": {"accelerator_type:H20": 2.0},
    }
    assert hosts3.run_python(NODES).check().result == want
    assert hosts3.run_python(NODES, host="c").check().result == want


SERVER = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('0.0.0.0', 47111)); s.listen(); print('ready', flush=True)\n"
    "while True:\n    s.accept()[0].close()\n"
)
CONNECT = (
    "import socket, sys\n"
    "s = socket.socket(); s.settimeout(10)\n"
    "try:\n    s.connect((sys.argv[1], 47111)); print('RESULT true')\n"
    "except OSError:\n    print('RESULT false')\n"
)


def test_hosts_do_not_share_a_loopback_but_reach_each_other_by_ip(hosts3):
    server = hosts3.popen("b", ["python3", "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        assert hosts3.run_driver(["-c", CONNECT, "127.0.0.1"], host="b").check().result is True
        assert hosts3.run_driver(["-c", CONNECT, "10.201.0.2"], host="c").check().result is True
        assert hosts3.run_driver(["-c", CONNECT, "127.0.0.1"], host="c").check().result is False
    finally:
        server.kill()
        server.wait()


AFFINITY = (
    "import json, os, ray\n"
    "ray.init(log_to_driver=False)\n"
    "task = ray.remote(num_cpus=0)(lambda: sorted(os.sched_getaffinity(0)))\n"
    "print('RESULT ' + json.dumps({'driver': sorted(os.sched_getaffinity(0)), 'task': ray.get(task.remote())}))\n"
)


def test_a_host_pinned_to_a_core_runs_there_and_teardown_removes_everything_also_on_failure():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    core = max(os.sched_getaffinity(0))  # hosts pinned to disjoint cores do not slow each other down
    spec = HostSpec("solo", {"H20": 1}, cpus=(core,))
    with pytest.raises(RuntimeError, match="the test failed"), start_hosts([spec]) as cluster:
        names = {cluster.bridge_namespace, cluster.head.namespace}
        pids = cluster.head.pids()
        assert names <= _namespaces() and pids
        # the host's Ray node, its driver and the workers it starts all run on that core only
        assert cluster.run_python(AFFINITY).check().result == {"driver": [core], "task": [core]}
        assert _affinities(cluster.head.pids()) == {frozenset({core})}
        raise RuntimeError("the test failed")
    assert not names & _namespaces()
    assert not cluster.dir.exists()
    assert all(_gone(pid) for pid in pids)


def _affinities(pids: list[int]) -> set[frozenset[int]]:
    """The distinct core sets of ``pids`` (a process that exited meanwhile is left out)."""
    out = set()
    for pid in pids:
        try:
            out.add(frozenset(os.sched_getaffinity(pid)))
        except ProcessLookupError:
            continue
    return out


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for init to reap it counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_bad_specs_are_refused_with_the_reason():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with pytest.raises(HostsError, match="unique"):
        start_hosts([HostSpec("a"), HostSpec("a")])
    with pytest.raises(HostsError, match=r"host a: cpus \[100000\] are not all among this process's cores"):
        start_hosts([HostSpec("a", cpus=(100000,))])
