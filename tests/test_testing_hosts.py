"""The namespace-host harness itself: isolation, hardware declared per host, teardown."""

import json
import os
import secrets
import subprocess
import sys

import pytest

from rollart.testing import HostsError, HostSpec, skip_reason, start_hosts
from rollart.testing.hosts import RUNS_DIR, _process_start, list_namespaces, sweep_stale_runs

NODES = (
    "import json, ray\n"
    "ray.init(log_to_driver=False)\n"
    "print('RESULT ' + json.dumps({n['NodeManagerAddress']: {k: v for k, v in n['Resources'].items()\n"
    "      if k.startswith('accelerator_type:')} for n in ray.nodes() if n['Alive']}))\n"
)


def _namespaces() -> set[str]:
    return set(list_namespaces())


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
        # and the packets it receives are processed there (RPS), not on the sender's core
        rps = subprocess.run(
            cluster.head.exec_args(["cat", "/sys/class/net/eth0/queues/rx-0/rps_cpus"]),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert int(rps.strip().replace(",", ""), 16) == 1 << core
        raise RuntimeError("the test failed")
    assert not names & _namespaces()
    assert not cluster.dir.exists()
    assert not (RUNS_DIR / f"{cluster.run_id}.json").exists()  # its owner record went with it
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


PLACE = (
    "import json, ray, time\n"
    "from ray.util.placement_group import placement_group, remove_placement_group\n"
    "ray.init(log_to_driver=False)\n"
    "pg = placement_group([{'accelerator_type:H20': 1}])\n"
    "try:\n"
    "    ray.get(pg.ready(), timeout=3)\n"
    "    placed = True\n"
    "except ray.exceptions.GetTimeoutError:\n"
    "    placed = False\n"
    "remove_placement_group(pg)\n"
    "print('RESULT ' + json.dumps(placed))\n"
)


def test_a_host_joins_a_running_cluster_and_a_drained_one_leaves_it_and_is_removed():
    """What an elastic run needs of the harness: a machine that joins mid-run, Ray's drain of it (nothing new
    is placed there; Ray removes the node once idle), and its removal."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with start_hosts([HostSpec("head", {"H800": 1})]) as cluster:
        assert cluster.run_python(PLACE).check().result is False  # no H20 anywhere yet
        d = cluster.add_host(HostSpec("d", {"H20": 1}))
        assert d.ip == "10.201.0.2" and d.namespace in _namespaces()
        assert cluster.run_python(NODES).check().result == {
            "10.201.0.1": {"accelerator_type:H800": 1.0},
            "10.201.0.2": {"accelerator_type:H20": 1.0},
        }
        assert cluster.run_python(PLACE).check().result is True  # the new host's device is usable
        node = cluster.drain_host("d")
        assert cluster.wait_host_gone("d", timeout_s=120)  # idle: Ray removes the drained node by itself
        alive = cluster.run_python(NODES).check().result
        assert list(alive) == ["10.201.0.1"], (node, alive)
        cluster.remove_host("d")
        assert d.namespace not in _namespaces() and not d.pids()
        with pytest.raises(KeyError):
            cluster.host("d")
        again = cluster.add_host(HostSpec("d", {"H20": 1}))  # a name can come back; its index and IP are new
        assert again.ip == "10.201.0.3"


def test_bad_specs_are_refused_with_the_reason():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with pytest.raises(HostsError, match="unique"):
        start_hosts([HostSpec("a"), HostSpec("a")])
    with pytest.raises(HostsError, match=r"host a: cpus \[100000\] are not all among this process's cores"):
        start_hosts([HostSpec("a", cpus=(100000,))])


def test_hosts_left_by_a_killed_owner_are_swept_and_a_live_owners_hosts_are_kept(tmp_path):
    """A test process SIGKILLed before its teardown leaves its namespaces, their processes and its
    directory behind; the next harness start removes them, and never touches a run whose owner lives."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    dead_run, live_run = secrets.token_hex(3), secrets.token_hex(3)
    dead_ns, live_ns = f"rat{dead_run}h0", f"rat{live_run}h0"
    dead_dir = tmp_path / f"rat{dead_run}-x"
    dead_dir.mkdir()
    owner = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    sleeper = None
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    records = [RUNS_DIR / f"{dead_run}.json", RUNS_DIR / f"{live_run}.json"]
    try:
        records[0].write_text(json.dumps({"pid": owner.pid, "start": _process_start(owner.pid), "dir": str(dead_dir)}))
        records[1].write_text(json.dumps({"pid": os.getpid(), "start": _process_start(os.getpid()), "dir": ""}))
        for ns in (dead_ns, live_ns):
            subprocess.run(["ip", "netns", "add", ns], check=True)
        sleeper = subprocess.Popen(
            ["ip", "netns", "exec", dead_ns, sys.executable, "-c", "import time; time.sleep(600)"]
        )
        assert dead_ns not in sweep_stale_runs()  # its owner still runs
        assert dead_ns in _namespaces() and records[0].exists() and sleeper.poll() is None
        owner.kill()  # the owner is SIGKILLed: no teardown of its own runs
        owner.wait(timeout=30)
        swept = sweep_stale_runs()
        assert dead_ns in swept and live_ns not in swept
        assert sleeper.wait(timeout=30) == -9  # the run's process, killed by pid
        assert dead_ns not in _namespaces() and not dead_dir.exists() and not records[0].exists()
        assert live_ns in _namespaces() and records[1].exists()  # a live owner's hosts stay
    finally:
        owner.kill()
        if sleeper is not None and sleeper.poll() is None:
            sleeper.kill()
        for ns in (dead_ns, live_ns):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        for r in records:
            r.unlink(missing_ok=True)
