"""``@register``: mark a worker method as callable through its Cluster (RollArt paper §5.1, "Single Controller")."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from rollart.decorators.specs import (
    REGISTER_ATTR,
    CollectFn,
    Dispatch,
    DispatchFn,
    Execute,
    RegisterSpec,
)

F = TypeVar("F", bound=Callable[..., Any])


def register(
    dispatch: Dispatch | str | tuple[DispatchFn, CollectFn] = Dispatch.ONE_TO_ALL,
    execute: Execute | str = Execute.ALL,
    *,
    by_ref: bool = False,
) -> Callable[[F], F]:
    """Expose a worker method on its Cluster with a dispatch mode.

    ``dispatch`` is a :class:`Dispatch` mode or a custom ``(dispatch_fn, collect_fn)`` pair:
    ``dispatch_fn(world_size, args, kwargs)`` returns one ``(args, kwargs)`` per rank (``None`` skips a
    rank) and ``collect_fn(results)`` turns the list of results of the ranks that ran into the answer.
    ``execute=Execute.RANK_ZERO`` runs only rank 0 (only meaningful with ``ONE_TO_ALL``).
    ``by_ref=True`` (plain ``def`` methods): the Cluster answers each rank's result as a ``ray.ObjectRef``
    that the caller owns instead of the value. A large result (a weight snapshot) then stays in the
    object store and can be passed on to other workers without the caller ever copying it; the call
    still completes, and a dead worker still fails it, like any other. A generator method with ``by_ref``
    is streamed: each item it yields becomes an object of its own as soon as it is yielded (the worker
    holds one item at a time) and each rank answers the list of its items' refs.
    The decorator only attaches metadata; the method is returned unchanged.
    """
    dispatch_fn: DispatchFn | None = None
    collect_fn: CollectFn | None = None
    mode: Dispatch | None
    if isinstance(dispatch, tuple):
        if len(dispatch) != 2 or not all(callable(f) for f in dispatch):
            raise TypeError(
                "register(dispatch=...) takes a Dispatch mode or a (dispatch_fn, collect_fn) pair of callables"
            )
        dispatch_fn, collect_fn = dispatch
        mode = None
    else:
        try:
            mode = Dispatch(dispatch)
        except ValueError:
            options = ", ".join(m.name for m in Dispatch)
            raise ValueError(f"register(dispatch={dispatch!r}): unknown mode; use one of {options}") from None
    try:
        exe = Execute(execute)
    except ValueError:
        options = ", ".join(m.name for m in Execute)
        raise ValueError(f"register(execute={execute!r}): unknown mode; use one of {options}") from None
    if exe is Execute.RANK_ZERO and mode not in (Dispatch.ONE_TO_ALL, Dispatch.RANK_ZERO):
        raise ValueError(
            f"register(execute=RANK_ZERO) only goes with dispatch=ONE_TO_ALL or RANK_ZERO, not {dispatch!r}"
        )
    spec = RegisterSpec(dispatch=mode, execute=exe, dispatch_fn=dispatch_fn, collect_fn=collect_fn, by_ref=by_ref)

    def mark(fn: F) -> F:
        if not callable(fn):
            raise TypeError("@register decorates a worker method")
        if by_ref and inspect.iscoroutinefunction(fn):
            raise TypeError(f"@register(by_ref=True) on {fn.__qualname__}: by_ref takes a plain def method, not async")
        setattr(fn, REGISTER_ATTR, spec)
        return fn

    return mark
