"""A Kubernetes API stand-in for tests: the REST paths of the official client, real processes for pods.

No Kubernetes API server can run on a test machine, so :class:`KubeStandIn` stands in for the API
server *and* the scheduler/kubelet; everything a user's code relies on -- the official ``kubernetes``
python client, kubeconfig loading, watches, readiness logic, the pods' own servers -- runs for real.

The API (``http://127.0.0.1:PORT``, bearer token auth, JSON) serves, for namespaced ``pods``,
``services`` and ``secrets`` under ``/api/v1/namespaces/{ns}/...`` and ``networkpolicies`` under
``/apis/networking.k8s.io/v1/namespaces/{ns}/...``: create (POST), get, list (``labelSelector`` with
``k=v``, ``k!=v``, ``k``, ``!k``), watch (``?watch=true``: chunked JSON lines of ``ADDED`` /
``MODIFIED`` / ``DELETED`` events, from ``resourceVersion`` or from the current state, ending after
``timeoutSeconds``), delete and delete-collection (with ``labelSelector``), and ``pods/{name}/log``.
Errors are ``Status`` objects (404 ``NotFound``, 409 ``AlreadyExists``, 422 ``Invalid``, 401).

Pods (one container each) go through the kubelet's transitions, each a ``MODIFIED`` event:

* ``Pending`` with ``PodScheduled=True``, a network namespace of its own (``rak<run>p<n>``) with an
  ``eth0`` on the run's bridge and its own ``podIP``, ``Initialized=True``, container ``waiting``
  ``ContainerCreating``;
* the image is looked up in :attr:`KubeStandIn.images` (``image name -> Image``): an unknown name or
  one registered with :meth:`KubeStandIn.add_unpullable` stays ``Pending`` with ``waiting``
  ``ErrImagePull`` then ``ImagePullBackOff``;
* else the container's process starts inside the pod's namespace: argv = ``command`` (or the image's
  entrypoint) + ``args`` (or the image's), where a leading ``python`` is this interpreter and a leading
  ``rollart`` is ``python -m rollart.cli``; ``env``
  from the container spec on top of :attr:`KubeStandIn.base_env`; phase ``Running``, container
  ``running``; ``Ready``/``ContainersReady`` follow the ``readinessProbe`` (``httpGet`` or
  ``tcpSocket``, probed from the node -- this process -- at the pod IP, with ``initialDelaySeconds``,
  ``periodSeconds``, ``timeoutSeconds``, ``failureThreshold``), or are ``True`` at start without one;
* a process that exits is ``terminated`` in ``lastState`` (exit code, ``Error``/``Completed``),
  ``restartCount`` + 1, ``waiting`` ``CrashLoopBackOff`` for a back-off that doubles each restart
  (``crash_backoff_s`` * 2^(n-1), capped at ``max_crash_backoff_s``: the kubelet's 10 s and 5 min
  scaled down), then started again (``restartPolicy`` ``Always``/``OnFailure``; ``Never`` ends in
  ``Failed``/``Succeeded``);
* delete sets ``deletionTimestamp`` (``MODIFIED``), kills the pod's processes (SIGTERM, then SIGKILL
  after ``grace_s``), removes its namespace, then the object (``DELETED``).

Services are stored and listed with a ``clusterIP`` (no proxying: reach pods by pod IP). Secrets are
stored with ``stringData`` folded into base64 ``data``, as the API server does, and a container's
``env`` ``valueFrom.secretKeyRef`` is read from them when its process starts. NetworkPolicies are
stored and listed as written (not enforced: pods' namespaces stay reachable from the node), and so is a
pod's ``securityContext`` (its process runs as the stand-in's user).

The network: a bridge in a namespace of the run's own and a veth pair from it to the caller's (root)
namespace carrying ``10.A.B.1/24`` (a /24 no route of the caller uses, picked at random), so the test
process reaches every pod at ``10.A.B.<n>``. :meth:`close` (also ``with``, a failed start, interpreter
exit) kills the pods' processes by pid, deletes the namespaces (which removes every link the run made)
and the run's directory. Needs root and ``ip`` (:func:`rollart.testing.hosts.skip_reason` says why not).

Usage::

    with KubeStandIn() as kube:
        kube.add_image("rollart/env-server:dev", ["python", "-m", "rollart.cli", "serve", "env"])
        kube.write_kubeconfig(tmp_path / "kubeconfig")
        # kubernetes.config.load_kube_config(str(tmp_path / "kubeconfig")) ...
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import http.server
import ipaddress
import json
import logging
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.parse
import urllib.request
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

from rollart.testing.hosts import HostsError, _netns_pids, _teardown, list_namespaces, run_ip

log = logging.getLogger(__name__)

KINDS = {
    "pods": ("Pod", "PodList"),
    "services": ("Service", "ServiceList"),
    "secrets": ("Secret", "SecretList"),
    "networkpolicies": ("NetworkPolicy", "NetworkPolicyList"),
}
API_VERSION = {"networkpolicies": "networking.k8s.io/v1"}


@dataclass
class Image:
    """What a container image runs: its entrypoint and default args (``python`` = this interpreter)."""

    entrypoint: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _set_condition(st: dict[str, Any], type_: str, value: bool) -> None:
    """Set a pod condition in the status ``st`` (its transition time changes only when its value does)."""
    conds = [x for x in st.get("conditions", []) if x["type"] != type_]
    old = next((x for x in st.get("conditions", []) if x["type"] == type_), None)
    if old is not None and old["status"] == str(value):
        conds.append(old)
    else:
        conds.append({"type": type_, "status": str(value), "lastTransitionTime": now()})
    order = ["PodScheduled", "Initialized", "ContainersReady", "Ready"]
    st["conditions"] = sorted(conds, key=lambda x: order.index(x["type"]))


def parse_selector(selector: str) -> list[tuple[str, str, str | None]]:
    """``a=b,c!=d,e,!f`` -> ``[(op, key, value)]`` with op in ``= != exists !exists``."""
    out: list[tuple[str, str, str | None]] = []
    for part in (p.strip() for p in selector.split(",") if p.strip()):
        if "!=" in part:
            k, v = part.split("!=", 1)
            out.append(("!=", k.strip(), v.strip()))
        elif "=" in part:
            k, v = part.replace("==", "=").split("=", 1)
            out.append(("=", k.strip(), v.strip()))
        elif part.startswith("!"):
            out.append(("!exists", part[1:].strip(), None))
        else:
            out.append(("exists", part, None))
    return out


def selects(selector: list[tuple[str, str, str | None]], labels: Mapping[str, str] | None) -> bool:
    labels = labels or {}
    for op, k, v in selector:
        if (
            (op == "=" and labels.get(k) != v)
            or (op == "!=" and labels.get(k) == v)
            or (op == "exists" and k not in labels)
            or (op == "!exists" and k in labels)
        ):
            return False
    return True


class _ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


@dataclass
class _Pod:
    key: tuple[str, str]
    index: int
    netns: str
    ip: str
    log_path: Path
    deleted: threading.Event = field(default_factory=threading.Event)
    proc: subprocess.Popen | None = None
    thread: threading.Thread | None = None


class KubeStandIn:
    """The API server stand-in (see the module docstring)."""

    def __init__(
        self,
        *,
        token: str | None = None,
        crash_backoff_s: float = 0.5,
        max_crash_backoff_s: float = 4.0,
        grace_s: float = 2.0,
        base_env: Mapping[str, str] | None = None,
        workdir: str | os.PathLike | None = None,
    ) -> None:
        from rollart.testing.hosts import skip_reason

        reason = skip_reason()
        if reason and "ray" not in reason:
            raise HostsError(reason)
        self.run_id = secrets.token_hex(3)
        self.token = token or secrets.token_hex(16)
        self.crash_backoff_s = crash_backoff_s
        self.max_crash_backoff_s = max_crash_backoff_s
        self.grace_s = grace_s
        self.base_env = dict(base_env if base_env is not None else _default_env())
        self.images: dict[str, Image] = {}
        self.unpullable: set[str] = set()
        self.dir = Path(tempfile.mkdtemp(prefix=f"rak{self.run_id}-", dir=workdir))
        self.bridge_namespace = f"rak{self.run_id}br"
        self.root_link = f"rak{self.run_id}"
        self._namespaces: list[str] = []
        self._objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {k: {} for k in KINDS}
        self._pods: dict[tuple[str, str], _Pod] = {}
        self._events: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, kind, type, object)
        self._rv = 1  # a list never answers "0" (which a watch reads as "from the current state")
        self._next_pod = 2
        self._cond = threading.Condition()
        self._closed = False
        self._finalizer = weakref.finalize(self, _teardown_all, self._namespaces, self.root_link, str(self.dir))
        try:
            self.subnet = self._build_network()
            self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
            self._httpd.daemon_threads = True
            self._serve = threading.Thread(target=self._httpd.serve_forever, name="kube-standin", daemon=True)
            self._serve.start()
        except BaseException:
            self.close()
            raise

    # --- public helpers ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def add_image(self, name: str, entrypoint: Sequence[str] = (), args: Sequence[str] = ()) -> None:
        """Make ``name`` pullable; a container of it runs ``entrypoint + args`` unless its spec overrides."""
        self.images[name] = Image(list(entrypoint), list(args))

    def add_unpullable(self, name: str) -> None:
        """Pods of image ``name`` end in ``ImagePullBackOff``."""
        self.unpullable.add(name)

    def write_kubeconfig(self, path: str | os.PathLike, namespace: str = "default") -> Path:
        """A kubeconfig for this server (token auth), readable by ``kubernetes.config.load_kube_config``."""
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "users": [{"name": "standin", "user": {"token": self.token}}],
            "contexts": [
                {"name": "standin", "context": {"cluster": "standin", "user": "standin", "namespace": namespace}}
            ],
            "current-context": "standin",
        }
        p = Path(path)
        p.write_text(json.dumps(cfg))  # JSON is YAML
        return p

    def pod_processes(self) -> dict[str, list[int]]:
        """``pod name -> pids`` running in each live pod's namespace."""
        with self._cond:
            pods = list(self._pods.values())
        return {p.key[1]: _netns_pids(p.netns) for p in pods}

    def live_namespaces(self) -> list[str]:
        """The network namespaces of this run that still exist (the bridge's included)."""
        return [ns for ns in list_namespaces() if ns.startswith(f"rak{self.run_id}")]

    def close(self) -> None:
        """Stop the server, kill every pod's processes, delete the namespaces and links. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._closed = True
            pods = list(self._pods.values())
            self._cond.notify_all()
        for p in pods:
            p.deleted.set()
        if hasattr(self, "_httpd"):
            self._httpd.shutdown()
            self._httpd.server_close()
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- network ---------------------------------------------------------------------------------------
    def _ip(self, *args: str) -> None:
        run_ip(*args)

    def _add_namespace(self, name: str) -> None:
        with self._cond:  # never after close(): its teardown would not see the namespace
            if self._closed and name != self.bridge_namespace:
                raise HostsError(f"the stand-in is closed: no namespace {name}")
            self._ip("netns", "add", name)
            self._namespaces.append(name)
        self._ip("-n", name, "link", "set", "lo", "up")

    def _build_network(self) -> ipaddress.IPv4Network:
        routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
        used = [ipaddress.ip_network(w, strict=False) for w in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?", routes)]
        rng = random.Random()
        for _ in range(100):
            net = ipaddress.IPv4Network(f"10.{rng.randint(202, 250)}.{rng.randint(0, 255)}.0/24")
            if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
                break
        else:
            raise HostsError("no free 10.x.y.0/24 for the stand-in's pod network")
        br = self.bridge_namespace
        self._add_namespace(br)
        self._ip("-n", br, "link", "add", "br0", "type", "bridge")
        self._ip("-n", br, "link", "set", "br0", "up")
        self._ip("link", "add", self.root_link, "type", "veth", "peer", "name", "node", "netns", br)
        self._ip("-n", br, "link", "set", "node", "master", "br0")
        self._ip("-n", br, "link", "set", "node", "up")
        self._ip("addr", "add", f"{net[1]}/24", "dev", self.root_link)
        self._ip("link", "set", self.root_link, "up")
        log.info("kube stand-in pod network %s (run %s)", net, self.run_id)
        return net

    def _pod_network(self, pod: _Pod) -> None:
        self._add_namespace(pod.netns)
        self._ip("link", "add", "eth0", "netns", pod.netns, "type", "veth", "peer", "name", f"p{pod.index}", "netns",
                 self.bridge_namespace)  # fmt: skip
        self._ip("-n", self.bridge_namespace, "link", "set", f"p{pod.index}", "master", "br0")
        self._ip("-n", self.bridge_namespace, "link", "set", f"p{pod.index}", "up")
        self._ip("-n", pod.netns, "addr", "add", f"{pod.ip}/24", "dev", "eth0")
        self._ip("-n", pod.netns, "link", "set", "eth0", "up")

    # --- the object store --------------------------------------------------------------------------------
    def _emit(self, kind: str, type_: str, obj: dict[str, Any]) -> None:
        """Bump the resourceVersion of ``obj`` and record the event (caller holds the lock)."""
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._events.append((self._rv, kind, type_, copy.deepcopy(obj)))
        self._cond.notify_all()

    def _update_pod(self, key: tuple[str, str], fn: Any) -> bool:
        """Apply ``fn(status)`` to a live pod and emit MODIFIED; False when the pod is gone."""
        with self._cond:
            obj = self._objects["pods"].get(key)
            if obj is None:
                return False
            fn(obj["status"])
            self._emit("pods", "MODIFIED", obj)
            return True

    def create(self, kind: str, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        meta = body.setdefault("metadata", {})
        name = meta.get("name") or (
            meta.get("generateName", "") + secrets.token_hex(3) if meta.get("generateName") else ""
        )
        if not name or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 63:
            raise _ApiError(422, "Invalid", f'{KINDS[kind][0]} "{name}" is invalid: metadata.name must be a DNS label')
        spec: dict[str, Any] = dict(body.get("spec") or {})
        obj: dict[str, Any] = {
            "apiVersion": API_VERSION.get(kind, "v1"),
            "kind": KINDS[kind][0],
            "metadata": {**meta, "name": name, "namespace": ns, "uid": str(uuid.uuid4()), "creationTimestamp": now()},
            "spec": spec,
            "status": {},
        }
        if kind == "secrets":
            data = {k: str(v) for k, v in (body.get("data") or {}).items()}
            for k, v in (body.get("stringData") or {}).items():
                data[k] = base64.b64encode(str(v).encode()).decode()
            obj = {k: v for k, v in obj.items() if k not in ("spec", "status")}
            obj.update(type=body.get("type", "Opaque"), data=data)
        elif kind == "networkpolicies":
            del obj["status"]
        if kind == "pods":
            containers = spec.get("containers") or []
            if len(containers) != 1 or not containers[0].get("name") or not containers[0].get("image"):
                raise _ApiError(422, "Invalid", f'Pod "{name}" is invalid: the stand-in runs exactly one container '
                                "with a name and an image")  # fmt: skip
            spec.setdefault("restartPolicy", "Always")
            obj["status"] = {"phase": "Pending", "conditions": [], "qosClass": "BestEffort"}
        elif kind == "services":
            spec.setdefault("type", "ClusterIP")
            spec["clusterIP"] = f"10.96.{random.randint(0, 255)}.{random.randint(1, 254)}"
            obj["status"] = {"loadBalancer": {}}
        with self._cond:
            if self._closed:
                raise _ApiError(503, "ServiceUnavailable", "the stand-in is shutting down")
            if (ns, name) in self._objects[kind]:
                raise _ApiError(409, "AlreadyExists", f'{kind} "{name}" already exists')
            if kind == "pods" and self._next_pod >= 254:
                raise _ApiError(503, "ServiceUnavailable", "the stand-in's /24 has no address left")
            self._objects[kind][(ns, name)] = obj
            self._emit(kind, "ADDED", obj)
            if kind == "pods":
                pod = _Pod((ns, name), self._next_pod, f"rak{self.run_id}p{self._next_pod}",
                           str(self.subnet[self._next_pod]), self.dir / f"{ns}_{name}.log")  # fmt: skip
                self._next_pod += 1
                self._pods[(ns, name)] = pod
                pod.thread = threading.Thread(target=self._kubelet, args=(pod,), name=f"kubelet-{name}", daemon=True)
                pod.thread.start()
            return copy.deepcopy(obj)

    def get(self, kind: str, ns: str, name: str) -> dict[str, Any]:
        with self._cond:
            obj = self._objects[kind].get((ns, name))
            if obj is None:
                raise _ApiError(404, "NotFound", f'{kind} "{name}" not found')
            return copy.deepcopy(obj)

    def list(self, kind: str, ns: str, selector: str) -> dict[str, Any]:
        sel = parse_selector(selector)
        with self._cond:
            items = [copy.deepcopy(o) for (n, _), o in sorted(self._objects[kind].items()) if n == ns
                     and selects(sel, o["metadata"].get("labels"))]  # fmt: skip
            return {"apiVersion": API_VERSION.get(kind, "v1"), "kind": KINDS[kind][1],
                    "metadata": {"resourceVersion": str(self._rv)},
                    "items": items}  # fmt: skip

    def delete(self, kind: str, ns: str, name: str) -> dict[str, Any]:
        with self._cond:
            obj = self._objects[kind].get((ns, name))
            if obj is None:
                raise _ApiError(404, "NotFound", f'{kind} "{name}" not found')
            if kind != "pods":
                del self._objects[kind][(ns, name)]
                self._emit(kind, "DELETED", obj)
                return copy.deepcopy(obj)
            if "deletionTimestamp" not in obj["metadata"]:
                obj["metadata"]["deletionTimestamp"] = now()
                obj["metadata"]["deletionGracePeriodSeconds"] = int(self.grace_s)
                self._emit(kind, "MODIFIED", obj)
                self._pods[(ns, name)].deleted.set()
            return copy.deepcopy(obj)

    def delete_collection(self, kind: str, ns: str, selector: str) -> dict[str, Any]:
        listed = self.list(kind, ns, selector)
        for obj in listed["items"]:
            try:
                self.delete(kind, ns, obj["metadata"]["name"])
            except _ApiError:
                pass
        return listed

    def watch(self, kind: str, ns: str, selector: str, rv: str | None, timeout_s: float) -> Iterator[dict[str, Any]]:
        """Events after ``rv`` (or ADDED for the current objects, then new events) until ``timeout_s``."""
        sel = parse_selector(selector)
        deadline = dt.datetime.now().timestamp() + timeout_s
        with self._cond:
            if rv in (None, "", "0"):
                start = self._rv
                backlog = [("ADDED", copy.deepcopy(o)) for (n, _), o in sorted(self._objects[kind].items()) if n == ns]
            else:
                start, backlog = int(rv), []
        for type_, obj in backlog:
            if selects(sel, obj["metadata"].get("labels")):
                yield {"type": type_, "object": obj}
        pos = start
        while True:
            with self._cond:
                while not self._closed and self._rv <= pos:
                    left = deadline - dt.datetime.now().timestamp()
                    if left <= 0:
                        return
                    self._cond.wait(min(left, 1.0))
                if self._closed:
                    return
                new = [e for e in self._events if e[0] > pos]
                pos = self._rv
            for _, k, type_, obj in new:
                if k == kind and obj["metadata"]["namespace"] == ns and selects(sel, obj["metadata"].get("labels")):
                    yield {"type": type_, "object": obj}

    def read_log(self, ns: str, name: str) -> str:
        self.get("pods", ns, name)
        pod = self._pods.get((ns, name))
        try:
            return pod.log_path.read_text(errors="replace") if pod else ""
        except FileNotFoundError:
            return ""

    # --- the kubelet ---------------------------------------------------------------------------------------
    def _kubelet(self, pod: _Pod) -> None:
        try:
            self._run_pod(pod)
        except Exception:  # a stand-in bug: visible in the test's log, the pod stays as it is
            log.exception("kube stand-in: pod %s/%s", *pod.key)
        finally:
            self._finish_pod(pod)

    def _run_pod(self, pod: _Pod) -> None:
        obj = self.get("pods", *pod.key)
        spec, c = obj["spec"], obj["spec"]["containers"][0]
        image = c["image"]

        def status(ready: bool = False, state: dict | None = None, **extra: Any) -> dict[str, Any]:
            return {"name": c["name"], "image": image, "imageID": "", "ready": ready, "started": False,
                    "restartCount": 0, "state": state or {}, **extra}  # fmt: skip

        cond = _set_condition
        self._pod_network(pod)

        def scheduled(st: dict[str, Any]) -> None:
            cond(st, "PodScheduled", True)
            st.update(podIP=pod.ip, podIPs=[{"ip": pod.ip}], hostIP=str(self.subnet[1]), startTime=now())

        self._update_pod(pod.key, scheduled)

        def creating(st: dict[str, Any]) -> None:
            cond(st, "Initialized", True)
            cond(st, "ContainersReady", False)
            cond(st, "Ready", False)
            st["containerStatuses"] = [status(state={"waiting": {"reason": "ContainerCreating"}})]

        self._update_pod(pod.key, creating)
        if image in self.unpullable or image not in self.images:
            self._fail_pull(pod, image)
            return
        argv, env = self._command(pod, c, image)
        probe = c.get("readinessProbe")
        restarts = 0
        while not pod.deleted.is_set():
            started = now()
            with open(pod.log_path, "ab") as logf:
                pod.proc = subprocess.Popen(["ip", "netns", "exec", pod.netns, *argv], env=env, stdout=logf,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, cwd=str(self.dir))  # fmt: skip

            def running(st: dict[str, Any], ready: bool = probe is None, rc: int = restarts, t0: str = started) -> None:
                st["phase"] = "Running"
                old = st["containerStatuses"][0]
                new = status(ready=ready, state={"running": {"startedAt": t0}}, started=True, restartCount=rc)
                if "lastState" in old:
                    new["lastState"] = old["lastState"]
                st["containerStatuses"] = [new]
                cond(st, "ContainersReady", ready)
                cond(st, "Ready", ready)

            self._update_pod(pod.key, running)
            self._probe_until_exit(pod, probe, c, running)
            if pod.deleted.is_set():
                return
            code = pod.proc.wait()
            restarts += 1
            policy = spec.get("restartPolicy", "Always")
            term = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "startedAt": started,
                    "finishedAt": now()}  # fmt: skip
            if policy == "Never" or (policy == "OnFailure" and code == 0):

                def ended(st: dict[str, Any], rc: int = code, t: dict = term, n: int = restarts - 1) -> None:
                    st["phase"] = "Succeeded" if rc == 0 else "Failed"
                    st["containerStatuses"] = [status(state={"terminated": t}, restartCount=n)]
                    cond(st, "ContainersReady", False)
                    cond(st, "Ready", False)

                self._update_pod(pod.key, ended)
                pod.deleted.wait()
                return
            backoff = min(self.max_crash_backoff_s, self.crash_backoff_s * 2 ** (restarts - 1))

            def crashed(st: dict[str, Any], n: int = restarts, t: dict = term, b: float = backoff) -> None:
                msg = f"back-off {b:g}s restarting failed container={c['name']} pod={pod.key[1]}"
                st["containerStatuses"] = [status(state={"waiting": {"reason": "CrashLoopBackOff", "message": msg}},
                                                  restartCount=n, lastState={"terminated": t})]  # fmt: skip
                cond(st, "ContainersReady", False)
                cond(st, "Ready", False)

            self._update_pod(pod.key, crashed)
            if pod.deleted.wait(backoff):
                return

    def _env_value(self, ns: str, entry: dict[str, Any]) -> str:
        """A container's variable: its ``value``, or its ``valueFrom.secretKeyRef`` read from the Secret."""
        ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
        if ref is None:
            return str(entry.get("value", ""))
        secret = self.get("secrets", ns, ref["name"])
        return base64.b64decode(secret["data"][ref["key"]]).decode()

    def _fail_pull(self, pod: _Pod, image: str) -> None:
        """An image that cannot be pulled: ``ErrImagePull`` then ``ImagePullBackOff``, until the pod is deleted."""
        msg = f'Back-off pulling image "{image}"'
        why = "pull access denied" if image in self.unpullable else "manifest unknown"
        for reason, text in (("ErrImagePull", f'failed to pull image "{image}": {why}'), ("ImagePullBackOff", msg)):
            self._update_pod(pod.key, lambda st, r=reason, t=text: st["containerStatuses"][0].update(
                state={"waiting": {"reason": r, "message": t}}))  # fmt: skip
            if pod.deleted.wait(self.crash_backoff_s):
                return
        pod.deleted.wait()

    def _command(self, pod: _Pod, c: dict[str, Any], image: str) -> tuple[Sequence[str], dict[str, str]]:
        """The container's argv (the image's entrypoint and args unless the container sets them; ``python``
        and ``rollart`` are this interpreter) and its environment."""
        img = self.images[image]
        argv = [*(c.get("command") or img.entrypoint), *c.get("args", img.args)]
        if not argv:
            raise RuntimeError(f"pod {pod.key}: image {image} has no entrypoint and the container no command")
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        elif argv[0] == "rollart":  # the project's console script, as an image of rollart would have it
            argv[:1] = [sys.executable, "-m", "rollart.cli"]
        env = {**self.base_env, **{e["name"]: self._env_value(pod.key[0], e) for e in c.get("env") or []}}
        env.update(POD_NAME=pod.key[1], POD_NAMESPACE=pod.key[0], POD_IP=pod.ip)
        return argv, env

    def _probe_until_exit(self, pod: _Pod, probe: dict | None, c: dict[str, Any], running: Any) -> None:
        """Probe readiness while the container runs; return when it exits or the pod is deleted."""
        assert pod.proc is not None
        if probe is None:
            while not pod.deleted.wait(0.05) and pod.proc.poll() is None:
                pass
            return
        period = float(probe.get("periodSeconds", 10))
        timeout = float(probe.get("timeoutSeconds", 1))
        failure_threshold = int(probe.get("failureThreshold", 3))
        ready, fails = False, 0
        if pod.deleted.wait(float(probe.get("initialDelaySeconds", 0))):
            return
        while not pod.deleted.is_set() and pod.proc.poll() is None:
            ok = self._probe(pod, probe, c, timeout)
            fails = 0 if ok else fails + 1
            now_ready = True if ok else (ready and fails < failure_threshold)
            if now_ready != ready:
                ready = now_ready
                self._update_pod(pod.key, lambda st, r=ready: running(st, ready=r))
            deadline = period
            while deadline > 0 and pod.proc.poll() is None:  # notice an exit within 50 ms
                if pod.deleted.wait(min(0.05, deadline)):
                    return
                deadline -= 0.05

    def _probe(self, pod: _Pod, probe: dict[str, Any], c: dict[str, Any], timeout: float) -> bool:
        def port_of(p: int | str) -> int:
            if isinstance(p, int) or str(p).isdigit():
                return int(p)
            for cp in c.get("ports") or []:
                if cp.get("name") == p:
                    return int(cp["containerPort"])
            return -1

        try:
            if "httpGet" in probe:
                hg = probe["httpGet"]
                url = f"http://{pod.ip}:{port_of(hg['port'])}{hg.get('path', '/')}"
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                with opener.open(url, timeout=timeout) as resp:
                    return 200 <= resp.status < 400
            if "tcpSocket" in probe:
                with socket.create_connection((pod.ip, port_of(probe["tcpSocket"]["port"])), timeout=timeout):
                    return True
            if "exec" in probe:
                argv = list(probe["exec"]["command"])
                done = subprocess.run(["ip", "netns", "exec", pod.netns, *argv], capture_output=True, timeout=timeout)
                return done.returncode == 0
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return False
        return False

    def _finish_pod(self, pod: _Pod) -> None:
        """Kill the pod's processes (TERM, then KILL after grace_s), remove its namespace and object."""
        if pod.proc is not None and pod.proc.poll() is None:
            _signal_all(pod.netns, signal.SIGTERM)
            try:
                pod.proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                pass
        for _ in range(50):
            if not _signal_all(pod.netns, signal.SIGKILL):
                break
            if pod.proc is not None:
                try:
                    pod.proc.wait(0.1)
                except subprocess.TimeoutExpired:
                    pass
        subprocess.run(["ip", "netns", "del", pod.netns], check=False, capture_output=True)
        with self._cond:
            if pod.netns in self._namespaces:
                self._namespaces.remove(pod.netns)
            self._pods.pop(pod.key, None)
            obj = self._objects["pods"].pop(pod.key, None)
            if obj is not None:
                self._emit("pods", "DELETED", obj)


def _signal_all(netns: str, sig: int) -> list[int]:
    pids = [p for p in _netns_pids(netns) if p != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def _default_env() -> dict[str, str]:
    keep = ("PATH", "PYTHONPATH", "ROLLART_WT", "HOME", "LANG", "OMP_NUM_THREADS")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _teardown_all(namespaces: list[str], root_link: str, directory: str) -> None:
    subprocess.run(["ip", "link", "del", root_link], check=False, capture_output=True, stdin=subprocess.DEVNULL)
    _teardown(namespaces, directory)


_KUBE_PATH = re.compile(
    r"^/(?:api/v1|apis/networking\.k8s\.io/v1)/namespaces/([^/]+)/(pods|services|secrets|networkpolicies)"
    r"(?:/([^/]+))?(/log)?$"
)


def _handler(kube: KubeStandIn) -> type[http.server.BaseHTTPRequestHandler]:
    """The HTTP handler class of ``kube``'s API server."""

    class Handler(_KubeHandler):
        pass

    Handler.kube = kube
    return Handler


class _KubeHandler(http.server.BaseHTTPRequestHandler):
    """The stand-in's Kubernetes API (the calls a kubernetes client makes for pods, services, secrets and
    network policies, with watches), answered by :attr:`kube`."""

    kube: ClassVar[KubeStandIn]
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("kube stand-in: " + fmt, *args)

    def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, err: _ApiError) -> None:
        status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
        self._send(err.code, {**status, "message": err.message, "reason": err.reason, "code": err.code})

    def _handle(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        q = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        try:
            if self.headers.get("Authorization") != f"Bearer {self.kube.token}":
                raise _ApiError(401, "Unauthorized", "Unauthorized")
            m = _KUBE_PATH.match(url.path)
            if m is None:
                raise _ApiError(404, "NotFound", f"the server could not find the requested resource {url.path}")
            ns, kind, name, logs = m.groups()
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}") if length else {}
            selector = q.get("labelSelector", "")
            if logs and method == "GET" and kind == "pods" and name:
                self._send(200, self.kube.read_log(ns, name), "text/plain")
            elif method == "POST" and not name:
                self._send(201, self.kube.create(kind, ns, body))
            elif method == "GET" and name:
                self._send(200, self.kube.get(kind, ns, name))
            elif method == "GET" and q.get("watch", "").lower() in ("true", "1"):
                timeout_s = float(q.get("timeoutSeconds", 3600))
                self._watch(self.kube.watch(kind, ns, selector, q.get("resourceVersion"), timeout_s))
            elif method == "GET":
                self._send(200, self.kube.list(kind, ns, selector))
            elif method == "DELETE" and name:
                self._send(200, self.kube.delete(kind, ns, name))
            elif method == "DELETE":
                self._send(200, self.kube.delete_collection(kind, ns, selector))
            else:
                raise _ApiError(405, "MethodNotAllowed", f"{method} {url.path} is not supported by the stand-in")
        except _ApiError as err:
            self._status(err)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _watch(self, events: Iterator[dict[str, Any]]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for ev in events:
            line = json.dumps(ev).encode() + b"\n"
            self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")
