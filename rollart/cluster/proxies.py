"""The callables a :class:`~rollart.cluster.cluster.Cluster` binds for each exposed method: planned and
collected calls on the ranks (``@register``), calls routed by tag to one serving rank (``@hw_mapping``,
rerouted when that rank dies) and HTTP calls (``@register_serverless``)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import ray

from rollart.cluster.dispatch import collect, plan_calls
from rollart.cluster.errors import NoLiveWorkerError
from rollart.cluster.future import ClusterFuture
from rollart.cluster.membership import Slot
from rollart.cluster.methods import ExposedMethod
from rollart.cluster.worker import BY_REF_PREFIX
from rollart.decorators.specs import Dispatch, HwMappingSpec, ServerlessSpec

log = logging.getLogger(__name__)


def bind_method(cluster: Any, m: ExposedMethod) -> None:
    """Set ``cluster.<m.name>`` to the proxy of ``m`` (its name, docstring and signature those of the method)."""
    if m.serverless is not None:
        proxy = serverless_proxy(cluster, m, m.serverless)
    elif m.hw_mapping is not None:
        proxy = routed_proxy(cluster, m, m.hw_mapping)
    else:
        proxy = dispatch_proxy(cluster, m)
    proxy.__name__ = m.name
    proxy.__qualname__ = f"Cluster[{cluster.worker_cls.__name__}].{m.name}"
    proxy.__doc__ = m.fn.__doc__
    try:
        params = list(inspect.signature(m.fn).parameters.values())[1:]
        proxy.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        pass
    setattr(cluster, m.name, proxy)


def proxy_for(cluster: Any, method: Callable[..., Any]) -> Callable[..., Any]:
    """The proxy ``cluster`` bound for ``method`` (the worker class's method, or an override of it in the
    worker's hierarchy); a ``TypeError`` naming the exposed methods for anything else."""
    name = getattr(method, "__name__", None)
    if not isinstance(name, str) or name not in cluster.methods:
        raise TypeError(
            f"cluster {cluster.name!r}: {method!r} is not an exposed method of "
            f"{cluster.worker_cls.__name__}; exposed methods are {sorted(cluster.methods)}"
        )
    owners = [
        c
        for c in cluster.worker_cls.__mro__
        if c.__dict__.get(name) is method or getattr(c.__dict__.get(name), "__func__", None) is method
    ]
    if not owners and cluster.methods[name].fn is not method:
        raise TypeError(
            f"cluster {cluster.name!r}: {getattr(method, '__qualname__', name)} is not a method of "
            f"{cluster.worker_cls.__name__} (pass {cluster.worker_cls.__name__}.{name})"
        )
    proxy: Callable[..., Any] = cluster.__dict__[name]
    return proxy


def dispatch_proxy(cluster: Any, m: ExposedMethod) -> Callable[..., Any]:
    """``@register``: planned by the dispatch mode, run on the alive ranks, collected."""
    spec = m.register
    assert spec is not None
    qual = f"{cluster.name}.{m.name}"
    skippable = spec.dispatch is Dispatch.ONE_TO_ALL and spec.dispatch_fn is None
    streamed = inspect.isgeneratorfunction(m.fn)  # by_ref: each rank answers the refs of what it yielded

    def call(*args: Any, blocking: bool = True, **kwargs: Any) -> Any:
        cluster._check_fatal()
        plan = plan_calls(spec, qual, cluster.world_size, args, kwargs)
        skip = skippable and cluster.skip_dead_ranks
        slots: list[Slot] = cluster._slots
        targets = [r for r, c in enumerate(plan) if c is not None]
        if skip:
            dead = [r for r in targets if not slots[r].alive]
            if dead and not cluster.recoverable():
                raise cluster._died(dead[0], cluster.members.last_death) from cluster.members.last_death
            targets = [r for r in targets if slots[r].alive]
        if len(targets) > 1:  # put shared arguments into the object store once, not once per rank
            plan = share_common_args(plan)
        calls = []
        results: dict[int, ray.ObjectRef] = {}  # by_ref: rank -> the result's ObjectRef
        for rank in targets:
            slot = slots[rank]
            if not slot.alive:
                raise cluster._died(rank)
            a, kw = plan[rank]  # type: ignore[misc]
            if spec.by_ref and streamed:  # one object per yielded item, the list of their refs answers
                method = getattr(slot.actor, BY_REF_PREFIX + m.name).options(num_returns="streaming")
                calls.append((rank, method.remote(*a, **kw)))
            elif spec.by_ref:
                method = getattr(slot.actor, BY_REF_PREFIX + m.name).options(num_returns=2)
                results[rank], done = method.remote(*a, **kw)
                calls.append((rank, done))  # answers the rank once the result is stored
            else:
                calls.append((rank, getattr(slot.actor, m.name).remote(*a, **kw)))
        fut: ClusterFuture[Any] = ClusterFuture(
            calls,
            (lambda ranks: collect(spec, [results[r] for r in ranks]))
            if spec.by_ref and not streamed
            else (lambda res: collect(spec, res)),
            cluster._dead_skip if skip else cluster._dead,
        )
        if m.is_async or not blocking:
            return fut
        return fut.result()

    return call


def submit_routed(cluster: Any, slot: Slot, method: str, args: tuple, kwargs: dict) -> ray.ObjectRef:
    """Send a routed call to ``slot``; its in-flight count drops when it is answered."""
    ref = getattr(slot.actor, method).remote(*args, **kwargs)
    ref.future().add_done_callback(lambda _: cluster.members.release(slot))
    return ref


def routed_proxy(cluster: Any, m: ExposedMethod, spec: HwMappingSpec) -> Callable[..., Any]:
    """``@hw_mapping``: one serving rank of the tag's preferred hardware; rerouted if it dies."""
    sig = inspect.signature(m.fn)

    def call(*args: Any, blocking: bool = True, **kwargs: Any) -> Any:
        try:
            bound = sig.bind(None, *args, **kwargs)
        except TypeError as err:
            raise TypeError(f"{cluster.name}.{m.name}: {err}") from None
        tag = bound.arguments.get("tag_name")
        if not isinstance(tag, str):
            raise TypeError(f"{cluster.name}.{m.name}: tag_name must be a string, got {tag!r}")
        cluster._check_fatal()
        slot = cluster._route(spec, tag)

        def reroute(rank: int, err: BaseException) -> tuple[int, ray.ObjectRef]:
            cluster._mark_dead(rank, err)
            cluster._check_fatal()
            try:
                nxt = cluster._route(spec, tag)
            except NoLiveWorkerError as none_left:
                raise cluster._died(rank, err) from none_left
            with cluster.members.lock:
                cluster.members.fault_counts["rerouted"] += 1
            log.info(
                "%s.%s: rank %d died, tag %r rerouted to rank %d (%s)",
                cluster.name,
                m.name,
                rank,
                tag,
                nxt.rank,
                nxt.hardware,
            )
            return nxt.rank, submit_routed(cluster, nxt, m.name, args, kwargs)

        fut: ClusterFuture[Any] = ClusterFuture(
            [(slot.rank, submit_routed(cluster, slot, m.name, args, kwargs))], lambda res: res[0], reroute
        )
        if m.is_async or not blocking:
            return fut
        return fut.result()

    return call


def serverless_proxy(cluster: Any, m: ExposedMethod, spec: ServerlessSpec) -> Callable[..., Any]:
    """``@register_serverless``: the arguments POSTed as JSON to the method's URL."""
    from rollart.cluster.serverless import RetryPolicy, acall_serverless, call_serverless

    sig = inspect.signature(m.fn)
    self_name = next(iter(sig.parameters))
    retry = RetryPolicy(retries=spec.retries, backoff_base_s=spec.backoff_base_s, backoff_max_s=spec.backoff_max_s)

    def payload_of(args: tuple, kwargs: dict) -> dict[str, Any]:
        try:
            bound = sig.bind(None, *args, **kwargs)
        except TypeError as err:
            raise TypeError(f"{cluster.name}.{m.name}: {err}") from None
        bound.apply_defaults()
        return {k: v for k, v in bound.arguments.items() if k != self_name}

    opts: dict[str, Any] = {
        "timeout_s": spec.timeout_s,
        "retry": retry,
        "token_env": spec.token_env,
        "tenant": cluster.job_id,
    }

    def call(*args: Any, blocking: bool = True, **kwargs: Any) -> Any:
        payload = payload_of(args, kwargs)
        if m.is_async:
            return acall_serverless(spec.url, payload, **opts)
        if not blocking:
            return cluster._pool_executor().submit(call_serverless, spec.url, payload, **opts)
        return call_serverless(spec.url, payload, **opts)

    return call


_NOT_SHARED = (int, float, str, bool, type(None), ray.ObjectRef)  # small, or already in the object store


def share_common_args(plan: list[Any]) -> list[Any]:
    """Replace arguments that are the same object for every rank by one object-store reference."""
    live = [p for p in plan if p is not None]
    first_args, first_kwargs = live[0]
    shared_pos = {
        i: ray.put(a)
        for i, a in enumerate(first_args)
        if all(len(p[0]) > i and p[0][i] is a for p in live) and not isinstance(a, _NOT_SHARED)
    }
    shared_kw = {
        k: ray.put(v)
        for k, v in first_kwargs.items()
        if all(p[1].get(k) is v for p in live) and not isinstance(v, _NOT_SHARED)
    }
    out: list[Any] = []
    for p in plan:
        if p is None:
            out.append(None)
            continue
        a, kw = p
        out.append(
            (
                tuple(shared_pos.get(i, x) for i, x in enumerate(a)),
                {k: shared_kw.get(k, v) for k, v in kw.items()},
            )
        )
    return out
