"""Hosts on one machine: a multi-node Ray cluster built from Linux network namespaces.

Each network namespace has its own interfaces and its own loopback, so a process in one host cannot
reach another host's ``127.0.0.1`` -- exactly like separate machines. :func:`start_hosts` builds

* one namespace per host (``rat<run>h<i>``) with ``lo`` up and an ``eth0`` carrying ``10.201.0.<i+1>/24``;
* a namespace of its own (``rat<run>br``) holding a bridge ``br0``, with the other end of every host's
  veth pair attached to it (so any number of hosts see each other);
* a Ray head in host 0 and a Ray node in every other host that joins it, each declaring its hardware
  as ``accelerator_type:<TYPE>`` units and a small ``num_cpus``; every node has a temp dir of its own
  (``--temp-dir``) under the run's directory, so no session file, socket or ``ray_current_cluster``
  of another Ray on the machine is read or written;
* token authentication (``RAY_AUTH_MODE=token``) with a token file of the run's own
  (``RAY_AUTH_TOKEN_PATH``), so ``~/.ray/auth_token`` is neither read nor created.

The subnet is private to the run: addresses exist only inside the run's namespaces, so parallel runs
(each with its own random run id) never collide, even with the same subnet. Teardown kills only the
processes that ``ip netns pids`` lists for the run's namespaces (never ``ray stop``, which would end
every Ray of the machine), deletes the namespaces (which removes their links) and the run's directory.
It runs on ``close()``, on leaving the ``with`` block, on a failed start, and at interpreter exit.
No handler survives a SIGKILL of the process that built the hosts, so every run also leaves an owner
record (``$TMPDIR/rollart-hosts/<run>.json``: its pid and that process's start time) until its
teardown; each new :class:`HostCluster` first tears down the runs whose owner is gone
(:func:`sweep_stale_runs`), and never one whose owner still runs.

Needs root and iproute2 (``ip``); :func:`skip_reason` says why a machine cannot build hosts.

Usage (tests use the ``hosts3`` fixture of ``tests/conftest.py``; a benchmark calls this directly)::

    from rollart.testing import HostSpec, start_hosts

    with start_hosts([HostSpec("head", {"H800": 2}), HostSpec("b", {"H800": 2}),
                      HostSpec("c", {"H20": 2})]) as cluster:
        res = cluster.run_driver(["-m", "my_driver", "--steps", "3"])   # inside the head host
        res.check()                        # raises with the driver's output on a non-zero exit
        res.result                         # JSON of the last ``RESULT {...}`` line of its stdout
        cluster.kill_host("c")             # every process of host c, by pid
        cluster.add_host(HostSpec("d", {"H20": 2}))  # a machine joins the running cluster
        cluster.drain_host("d")            # Ray's drain: marked for removal (Ray removes it once idle)
        cluster.wait_host_gone("d")        # its Ray node left the cluster
        cluster.remove_host("d")           # its namespace and processes gone

Inside a driver started by :meth:`HostCluster.run_driver`, ``RAY_ADDRESS`` names the head
(``10.201.0.1:6379``) and ``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN_PATH`` are set, so
``rollart.resource_manager.launcher.ensure_ray()`` (or ``ray.init()``) joins the cluster.
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is removed from every environment the harness builds: set, even
to 0, it makes ``ray start --address`` refuse to join.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from rollart.resource_manager.allocator import DEFAULT_ARENAS

log = logging.getLogger(__name__)

SUBNET_PREFIX = "10.201.0"
"""Hosts get ``10.201.0.1``, ``10.201.0.2``, ... (/24) on links that exist only in the run's namespaces."""
RAY_PORT = 6379
"""The GCS port of the head (inside the head's namespace: no clash with any other Ray)."""
DASHBOARD_PORT = 8265
"""The head's dashboard / Ray Jobs port when started with ``dashboard=True`` (on the head's own IP)."""
RUNS_DIR = Path(tempfile.gettempdir()) / "rollart-hosts"
"""Owner records of the runs not torn down yet (see :func:`sweep_stale_runs`)."""
RESULT_PREFIX = "RESULT "
"""A driver prints ``RESULT <json>`` on stdout; :attr:`DriverResult.result` parses the last one."""

_DROP_ENV = (
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    "RAY_ADDRESS",
    "RAY_NAMESPACE",
    "RAY_AUTH_TOKEN",
    # one host's address or interface, set in the test process by a single-host run (the Mooncake client
    # and the DDP set-up write them): inherited by another host, they would bind it to 127.0.0.1 / lo
    "MC_TCP_BIND_ADDRESS",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
)


def skip_reason() -> str | None:
    """Why this machine cannot build namespace hosts (not root, no ``ip``, not Linux), or None."""
    if not sys.platform.startswith("linux"):
        return "namespace hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "namespace hosts need root (ip netns add); run the multi-host tests as root"
    if shutil.which("ip") is None:
        return "namespace hosts need iproute2's `ip` command on PATH"
    if shutil.which("ray", path=str(Path(sys.executable).parent)) is None and shutil.which("ray") is None:
        return "the `ray` command is not installed next to this Python"
    return None


@dataclass(frozen=True)
class HostSpec:
    """One host: a name, its logical hardware (``{"H800": 2}`` -> ``accelerator_type:H800 = 2``), CPUs."""

    name: str
    hardware: Mapping[str, float] = field(default_factory=dict)
    num_cpus: int = 1
    object_store_mb: int = 128
    # the machine's cores this host's processes may run on (``taskset``); None: all of them. Pinning
    # hosts to disjoint cores keeps one host's work from slowing another's, as on separate machines.
    # A pinned host also receives its packets on its own cores: the kernel's receive work for a veth
    # runs on the *sender's* core unless steered (RPS on the host's ``eth0``), so without it a host that
    # sends a lot (a trainer serving weights) would pay its receivers' share of the work as well.
    cpus: tuple[int, ...] | None = None


def three_hosts(num_cpus: int = 2) -> list[HostSpec]:
    """The issue's reference cluster: ``head`` (driver, train pool on ``H800``), ``b`` (rollout ``H800``),
    ``c`` (rollout ``H20``), two devices each."""
    return [
        HostSpec("head", {"H800": 2}, num_cpus=num_cpus),
        HostSpec("b", {"H800": 2}, num_cpus=num_cpus),
        HostSpec("c", {"H20": 2}, num_cpus=num_cpus),
    ]


class HostsError(RuntimeError):
    """The harness could not build or drive the hosts; the message carries the failing command's output."""


@dataclass
class DriverResult:
    """A finished driver: return code, output, and the JSON of its last ``RESULT`` line (or None)."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def result(self) -> object | None:
        lines = [ln for ln in self.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
        return json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines else None

    def check(self) -> DriverResult:
        if self.returncode != 0:
            raise HostsError(
                f"driver {self.args} exited with {self.returncode}\n--- stdout ---\n"
                f"{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-6000:]}"
            )
        return self


@dataclass
class Host:
    """A started host: its namespace, IP, hardware and Ray temp dir."""

    index: int
    name: str
    namespace: str
    ip: str
    hardware: dict[str, float]
    num_cpus: int
    temp_dir: Path
    cpus: tuple[int, ...] | None = None

    def exec_args(self, args: Sequence[str]) -> list[str]:
        """``args`` prefixed so that they run inside this host's namespace (on its ``cpus``, if given)."""
        pin = ["taskset", "-c", ",".join(map(str, self.cpus))] if self.cpus else []
        return ["ip", "netns", "exec", self.namespace, *pin, *args]

    def pids(self) -> list[int]:
        """Every process running in this host's namespace."""
        return _netns_pids(self.namespace)

    def kill_all(self, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process of this host (as when the machine dies); return their pids."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids


class HostCluster:
    """N namespace hosts with a Ray cluster on them; host 0 runs the Ray head."""

    def __init__(
        self,
        specs: Sequence[HostSpec],
        *,
        ray_port: int = RAY_PORT,
        start_timeout_s: float = 300.0,
        workdir: str | os.PathLike | None = None,
        dashboard: bool = False,
    ) -> None:
        reason = skip_reason()
        if reason:
            raise HostsError(reason)
        if not specs:
            raise HostsError("start_hosts needs at least one HostSpec")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise HostsError(f"host names must be unique, got {names}")
        if len(specs) > 250:
            raise HostsError("at most 250 hosts fit the /24 test subnet")
        usable = os.sched_getaffinity(0)
        for s in specs:
            if s.cpus is not None and (not s.cpus or not set(s.cpus) <= usable):
                raise HostsError(
                    f"host {s.name}: cpus {list(s.cpus)} are not all among this process's cores {sorted(usable)}; "
                    "name cores from that list, or leave cpus unset"
                )
        sweep_stale_runs()
        self.run_id = secrets.token_hex(3)
        self.ray_port = ray_port
        self.dashboard = dashboard
        self.start_timeout_s = start_timeout_s
        self.dir = Path(tempfile.mkdtemp(prefix=f"rat{self.run_id}-", dir=workdir))
        self._record = _write_owner_record(self.run_id, self.dir)
        self.token_path = self.dir / "auth_token"
        self.bridge_namespace = f"rat{self.run_id}br"
        self.hosts: list[Host] = [
            Host(
                index=i,
                name=s.name,
                namespace=f"rat{self.run_id}h{i}",
                ip=f"{SUBNET_PREFIX}.{i + 1}",
                hardware={k: float(v) for k, v in s.hardware.items()},
                num_cpus=s.num_cpus,
                temp_dir=self.dir / f"h{i}",
                cpus=s.cpus,
            )
            for i, s in enumerate(specs)
        ]
        self._specs = dict(enumerate(specs))  # by host index
        self._next_index = len(specs)  # host indexes (and so IPs and namespaces) are never reused
        self._namespaces: list[str] = []
        self._closed = False
        # the finalizer holds no reference to self (it tears down by namespace name and directory); it
        # runs on close(), when the object is collected, or at interpreter exit (weakref.finalize's atexit)
        self._finalizer = weakref.finalize(self, _teardown, self._namespaces, str(self.dir), str(self._record))
        try:
            self._build_network()
            self._start_ray()
        except BaseException:
            self.close()
            raise

    # --- addresses and environments ---------------------------------------------------------------
    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def address(self) -> str:
        """The Ray address of the cluster (``RAY_ADDRESS``): the head's IP and GCS port."""
        return f"{self.head.ip}:{self.ray_port}"

    @property
    def jobs_address(self) -> str:
        """The Ray Jobs (dashboard) address of the head, ``http://10.201.0.1:8265``; needs ``dashboard=True``."""
        if not self.dashboard:
            raise HostsError("the head runs without a dashboard: start the hosts with dashboard=True for Ray Jobs")
        return f"http://{self.head.ip}:{DASHBOARD_PORT}"

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host named {name!r}; hosts are {[h.name for h in self.hosts]}")

    def host_of_ip(self, ip: str) -> Host:
        for h in self.hosts:
            if h.ip == ip:
                return h
        raise KeyError(f"no host has IP {ip!r}")

    def env(self, extra: Mapping[str, str] | None = None, *, with_address: bool = True) -> dict[str, str]:
        """The environment of a process in this cluster: token auth with the run's token, the cluster's
        ``RAY_ADDRESS`` (unless ``with_address=False``), one thread per library, two malloc arenas
        (``MALLOC_ARENA_MAX``, as rollart's local Ray has them: see ``resource_manager.allocator``),
        no ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``."""
        env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
        env.update(
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(self.token_path),
            RAY_USAGE_STATS_ENABLED="0",
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
            MALLOC_ARENA_MAX=env.get("MALLOC_ARENA_MAX", str(DEFAULT_ARENAS)),
        )
        if with_address:
            env["RAY_ADDRESS"] = self.address
        env.update(extra or {})
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        return env

    # --- running things in hosts -------------------------------------------------------------------
    def run(
        self,
        host: str | Host,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = 300,
        cwd: str | os.PathLike | None = None,
    ) -> DriverResult:
        """Run ``args`` inside ``host`` with :meth:`env`; wait for it and return its output."""
        h = host if isinstance(host, Host) else self.host(host)
        return self._run(h, args, self.env(env), timeout, cwd)

    def _run(
        self,
        h: Host,
        args: Sequence[str],
        env: Mapping[str, str],
        timeout: float | None,
        cwd: str | os.PathLike | None = None,
    ) -> DriverResult:
        try:
            proc = subprocess.run(
                h.exec_args(list(args)),
                check=False,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                cwd=cwd,
            )
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            return DriverResult(list(args), 124, out, err + f"\n[harness] timed out after {timeout}s")
        return DriverResult(list(args), proc.returncode, proc.stdout, proc.stderr)

    def popen(
        self, host: str | Host, args: Sequence[str], *, env: Mapping[str, str] | None = None, **kw: object
    ) -> subprocess.Popen:
        """Start ``args`` inside ``host`` without waiting (the caller owns the process)."""
        h = host if isinstance(host, Host) else self.host(host)
        kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(h.exec_args(list(args)), env=self.env(env), **kw)  # type: ignore[call-overload]

    def run_driver(
        self,
        args: Sequence[str],
        *,
        host: str | Host | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = 300,
        cwd: str | os.PathLike | None = None,
    ) -> DriverResult:
        """Run a Python driver (``["path/to/script.py", ...]`` or ``["-m", "module", ...]``) with this
        Python inside ``host`` (default: the head), ``RAY_ADDRESS`` set to the cluster."""
        return self.run(host or self.head, [sys.executable, *args], env=env, timeout=timeout, cwd=cwd)

    def run_python(
        self,
        code: str,
        *,
        host: str | Host | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = 300,
    ) -> DriverResult:
        """Run Python source ``code`` as a driver inside ``host`` (default: the head)."""
        return self.run_driver(["-c", code], host=host, env=env, timeout=timeout)

    def kill_host(self, name: str, sig: int = signal.SIGKILL) -> list[int]:
        """Kill every process of host ``name`` (its Ray node and whatever runs there); return the pids."""
        return self.host(name).kill_all(sig)

    def restart_host(self, name: str) -> None:
        """Start host ``name``'s Ray node again (after :meth:`kill_host`) and wait until the cluster lists
        it alive; the head cannot be restarted (the cluster's GCS lives there)."""
        h = self.host(name)
        if h.index == 0:
            raise HostsError("the head host cannot be restarted: its GCS holds the cluster; build a new HostCluster")
        h.kill_all()
        self._ray_start(h, head=False)
        self._wait_nodes()

    def add_host(self, spec: HostSpec) -> Host:
        """Start one more host and join its Ray node to the running cluster (a machine that joins mid-run);
        returns it once the cluster lists it alive. Its index, IP and namespace are new (never reused)."""
        if any(h.name == spec.name for h in self.hosts):
            raise HostsError(f"a host named {spec.name!r} exists; choose another name")
        index = self._next_index
        if index >= 250:
            raise HostsError("at most 250 hosts fit the /24 test subnet")
        self._next_index += 1
        h = Host(
            index=index,
            name=spec.name,
            namespace=f"rat{self.run_id}h{index}",
            ip=f"{SUBNET_PREFIX}.{index + 1}",
            hardware={k: float(v) for k, v in spec.hardware.items()},
            num_cpus=spec.num_cpus,
            temp_dir=self.dir / f"h{index}",
            cpus=spec.cpus,
        )
        self._specs[index] = spec
        self.hosts.append(h)
        try:
            self._link_host(h)
            self._ray_start(h, head=False)
            self._wait_nodes()
        except BaseException:
            self.remove_host(h.name)
            raise
        log.info("host %s (%s) joined run %s", h.name, h.ip, self.run_id)
        return h

    def node_id(self, name: str) -> str:
        """The Ray node id of host ``name``'s alive node."""
        ip = self.host(name).ip
        code = (
            "import json, ray\n"
            "ray.init(log_to_driver=False)\n"
            f"ids = [n['NodeID'] for n in ray.nodes() if n['Alive'] and n['NodeManagerAddress'] == {ip!r}]\n"
            "print('RESULT ' + json.dumps(ids))\n"
        )
        ids = self.run_python(code, timeout=120).check().result
        if not ids:
            raise HostsError(f"host {name} ({ip}) has no alive Ray node")
        return str(ids[0])  # type: ignore[index]

    def drain_host(self, name: str, reason: str = "DRAIN_NODE_REASON_PREEMPTION", deadline_s: int = 600) -> str:
        """Mark host ``name``'s Ray node for removal with Ray's drain API (``ray drain-node``, what an autoscaler
        does before it removes a node): Ray places nothing new there and removes the node once nothing runs
        on it. Returns the node id."""
        node = self.node_id(name)
        args = [_ray_bin(), "drain-node", f"--address={self.address}", f"--node-id={node}", f"--reason={reason}"]
        args += ["--reason-message=rollart.testing: host drained", f"--deadline-remaining-seconds={deadline_s}"]
        self.run(self.head, args, timeout=120).check()
        return node

    def wait_host_gone(self, name: str, timeout_s: float = 300.0) -> bool:
        """Wait until the cluster lists no alive node at host ``name``'s IP (True), or ``timeout_s`` passes."""
        ip = self.host(name).ip
        code = (
            "import json, time, ray\n"
            "ray.init(log_to_driver=False)\n"
            f"deadline = time.monotonic() + {timeout_s}\n"
            f"while any(n['Alive'] and n['NodeManagerAddress'] == {ip!r} for n in ray.nodes()):\n"
            "    if time.monotonic() > deadline: break\n"
            "    time.sleep(0.2)\n"
            f"print('RESULT ' + json.dumps(not any(n['Alive'] and n['NodeManagerAddress'] == {ip!r} for n in ray.nodes())))\n"
        )
        return bool(self.run_python(code, timeout=timeout_s + 60).result)

    def remove_host(self, name: str) -> None:
        """Kill every process of host ``name``, delete its namespace (and its link) and forget it (the machine
        is gone; the cluster notices its node's death by itself)."""
        h = self.host(name)
        if h.index == 0:
            raise HostsError("the head host cannot be removed: its GCS holds the cluster")
        _teardown([h.namespace] if h.namespace in self._namespaces else [], "")
        if h.namespace in self._namespaces:
            self._namespaces.remove(h.namespace)
        subprocess.run(
            ["ip", "-n", self.bridge_namespace, "link", "del", f"p{h.index}"],
            check=False,
            capture_output=True,
            stdin=subprocess.DEVNULL,
        )
        self.hosts.remove(h)

    # --- building ------------------------------------------------------------------------------------
    def _ip(self, *args: str) -> None:
        run_ip(*args)

    def _add_namespace(self, name: str) -> None:
        self._ip("netns", "add", name)
        self._namespaces.append(name)
        self._ip("-n", name, "link", "set", "lo", "up")

    def _build_network(self) -> None:
        br = self.bridge_namespace
        self._add_namespace(br)
        self._ip("-n", br, "link", "add", "br0", "type", "bridge")
        self._ip("-n", br, "link", "set", "br0", "up")
        for h in self.hosts:
            self._link_host(h)
        log.info("hosts %s on %s.0/24 (run %s)", [(h.name, h.ip) for h in self.hosts], SUBNET_PREFIX, self.run_id)

    def _link_host(self, h: Host) -> None:
        """``h``'s namespace, with an ``eth0`` whose peer is on the bridge."""
        br = self.bridge_namespace
        self._add_namespace(h.namespace)
        # both ends are created directly inside their namespaces: no name in the root namespace
        self._ip(
            "link", "add", "eth0", "netns", h.namespace, "type", "veth", "peer", "name", f"p{h.index}", "netns", br
        )
        self._ip("-n", br, "link", "set", f"p{h.index}", "master", "br0")
        self._ip("-n", br, "link", "set", f"p{h.index}", "up")
        self._ip("-n", h.namespace, "addr", "add", f"{h.ip}/24", "dev", "eth0")
        self._ip("-n", h.namespace, "link", "set", "eth0", "up")
        if h.cpus:
            self._steer_receive(h)

    def _steer_receive(self, h: Host) -> None:
        """Receive processing of ``h``'s ``eth0`` on ``h``'s own cores (RPS), as on its own machine."""
        mask = f"{sum(1 << c for c in h.cpus or ()):x}"
        path = "/sys/class/net/eth0/queues/rx-0/rps_cpus"
        proc = subprocess.run(
            ["ip", "netns", "exec", h.namespace, "sh", "-c", f"echo {mask} > {path}"],
            check=False,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise HostsError(f"host {h.name}: could not set {path} to {mask}: {proc.stderr.strip()}")

    def _ray_start(self, h: Host, head: bool) -> None:
        h.temp_dir.mkdir(parents=True, exist_ok=True)
        resources = {f"accelerator_type:{k}": v for k, v in h.hardware.items() if v > 0}
        spec = self._specs[h.index]
        args = [
            _ray_bin(),
            "start",
            f"--node-ip-address={h.ip}",
            f"--num-cpus={h.num_cpus}",
            "--num-gpus=0",
            f"--resources={json.dumps(resources)}",
            f"--temp-dir={h.temp_dir}",
            f"--object-store-memory={spec.object_store_mb * 1024 * 1024}",
            "--disable-usage-stats",
        ]
        if head:
            args += ["--head", f"--port={self.ray_port}"]
            if self.dashboard:  # the Ray Jobs API: the dashboard on the head's own link, its job agent
                args += ["--include-dashboard=true", f"--dashboard-host={h.ip}", f"--dashboard-port={DASHBOARD_PORT}"]
            else:
                args += ["--include-dashboard=false"]
        else:
            args += [f"--address={self.address}"]
        res = self._run(h, args, self.env(with_address=False), self.start_timeout_s)
        if res.returncode != 0:
            raise HostsError(
                f"ray start on host {h.name} ({h.ip}) failed ({res.returncode}):\n"
                f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
            )

    def _start_ray(self) -> None:
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        self._ray_start(self.head, head=True)
        for h in self.hosts[1:]:
            self._ray_start(h, head=False)
        self._wait_nodes()

    def _wait_nodes(self) -> None:
        """Wait until the head's GCS lists every host as an alive node (ray start returns before that),
        and no other node alive at a host's IP."""
        want = sorted(h.ip for h in self.hosts)
        code = (
            "import json, time, ray\n"
            "ray.init(log_to_driver=False)\n"
            f"want = {want!r}\n"
            f"deadline = time.monotonic() + {self.start_timeout_s}\n"
            "while True:\n"
            "    alive = sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])\n"
            "    if alive == want or time.monotonic() > deadline: break\n"
            "    time.sleep(0.2)\n"
            "print('RESULT ' + json.dumps(alive))\n"
        )
        res = self.run_python(code, timeout=self.start_timeout_s + 60)
        if res.result != want:
            raise HostsError(
                f"the cluster did not list every host as alive: want {want}, got {res.result}\n{res.stderr[-3000:]}"
            )

    # --- teardown --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process of the run's namespaces, delete them and the run's directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_hosts(specs: Sequence[HostSpec], **kw: object) -> HostCluster:
    """Build the hosts and their Ray cluster (see the module docstring); use as a context manager."""
    return HostCluster(specs, **kw)  # type: ignore[arg-type]


def run_ip(*args: str) -> None:
    """``ip ARGS`` (iproute2); raises :class:`HostsError` with its stderr when it fails."""
    proc = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise HostsError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")


def _ray_bin() -> str:
    local = Path(sys.executable).parent / "ray"
    return str(local) if local.exists() else (shutil.which("ray") or "ray")


def _netns_pids(namespace: str) -> list[int]:
    proc = subprocess.run(
        ["ip", "netns", "pids", namespace], check=False, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (``/proc/<pid>/stat`` field 22; None when it does not exist):
    with the pid, it names one process even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _write_owner_record(run_id: str, directory: Path) -> Path:
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    record = RUNS_DIR / f"{run_id}.json"
    pid = os.getpid()
    record.write_text(json.dumps({"pid": pid, "start": _process_start(pid), "dir": str(directory)}))
    return record


def list_namespaces() -> list[str]:
    """The names ``ip netns list`` shows."""
    proc = subprocess.run(
        ["ip", "netns", "list"], check=False, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def sweep_stale_runs() -> list[str]:
    """Tear down every run whose owner process is gone (SIGKILLed before its teardown ran): kill the
    processes of its namespaces by pid, delete the namespaces, its directory and its record. Runs whose
    owner still runs are left alone, whoever started them. Returns the namespaces deleted."""
    if not RUNS_DIR.is_dir():
        return []
    swept: list[str] = []
    existing: list[str] | None = None  # listed once, at the first stale run
    for record in sorted(RUNS_DIR.glob("*.json")):
        try:
            owner = json.loads(record.read_text())
        except (OSError, ValueError):
            continue  # being written (or already swept by a parallel run)
        if owner.get("start") is not None and _process_start(int(owner["pid"])) == owner["start"]:
            continue
        if existing is None:
            existing = list_namespaces()
        pattern = re.compile(rf"rat{re.escape(record.stem)}(br|h\d+)")
        namespaces = [ns for ns in existing if pattern.fullmatch(ns)]
        _teardown(namespaces[:], str(owner.get("dir", "")), str(record))
        swept += namespaces
        log.warning("hosts of run %s (owner pid %s is gone) torn down: %s", record.stem, owner.get("pid"), namespaces)
    return swept


def _teardown(namespaces: list[str], directory: str, record: str = "") -> None:
    """Kill the processes of ``namespaces`` (by pid), delete the namespaces, ``directory`` and the
    run's owner ``record``."""
    for _ in range(50):
        pids = [p for ns in namespaces for p in _netns_pids(ns) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)  # teardown only: let the kernel reap the killed processes before deleting
    for ns in reversed(namespaces):
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, stdin=subprocess.DEVNULL)
    namespaces.clear()
    if directory:
        shutil.rmtree(directory, ignore_errors=True)
    if record:
        Path(record).unlink(missing_ok=True)
