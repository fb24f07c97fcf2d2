"""Plug-ins named in a YAML config: ``MODULE:NAME`` imports and checks against a signature.

A config names a user's object as ``MODULE:NAME`` (``my_envs:CopyEnv``, ``my_algos:my_loss``); the
module is looked up in the config file's folder, the working directory and the installed packages.
:func:`import_object` returns the object or raises :class:`PluginError` naming the config field and
the fix; :func:`signature_problems` checks keyword arguments from a config against a callable's
signature (names and, where annotated, types) without calling it. Nothing here imports torch or Ray.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class PluginError(ValueError):
    """A plug-in named in a config cannot be used; ``str(err)`` starts with the config field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


def checked(check: Callable[..., Any], *args: Any, prefix: str = "") -> Any:
    """``check(*args)`` inside a pydantic validator (whose location already names the field): a
    :class:`PluginError` becomes a ``ValueError`` without its own field prefix, and a non-empty list of
    problems that the check returns is raised as one ``ValueError`` (after ``prefix``)."""
    try:
        result = check(*args)
    except PluginError as err:
        raise ValueError(err.message) from None
    if isinstance(result, list) and result:
        raise ValueError(prefix + "; ".join(result))
    return result


class LazyModule:
    """Stands for the module ``name`` in the globals of the module that made it, and imports it on its first
    attribute access, then puts the module itself in its place. The loss, advantage and aggregation
    modules use it for torch: a config names their functions and is checked against their signatures
    without importing torch, so ``rollart run`` starts Ray before torch has loaded (torch imports beside it)."""

    def __init__(self, name: str, namespace: dict[str, Any], alias: str | None = None) -> None:
        self._name = name
        self._namespace = namespace
        self._alias = alias or name

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self._name)
        self._namespace[self._alias] = module
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<{self._name}, imported at first use>"


def is_spec(value: object) -> bool:
    """Whether ``value`` is written as ``MODULE:NAME`` (a plug-in), not a registry name."""
    return isinstance(value, str) and ":" in value


_SEARCHED: list[str] = []  # the folders add_search_path put on sys.path, in order
FAILED_IMPORTS: dict[str, str] = {}  # module -> why it failed to import (already reported once)


def add_search_path(paths: Iterable[str | Path]) -> list[str]:
    """Make modules in ``paths`` (folders) importable: each is appended to ``sys.path`` once (after the
    installed packages, so a user's file never shadows one). Returns the absolute folders."""
    added = []
    for p in paths:
        folder = str(Path(p).resolve())
        if folder not in sys.path:
            sys.path.append(folder)
        if folder not in _SEARCHED:
            _SEARCHED.append(folder)
        added.append(folder)
    return added


def _where(first: Sequence[str]) -> str:
    return ", ".join(dict.fromkeys([*first, *_SEARCHED]))


def import_module(module: str, field: str, search_path: Sequence[str | Path] = ()) -> Any:
    """Import ``module`` for the config ``field``; :class:`PluginError` says whether it was not found or
    failed while importing (with the exception), and where it was looked for."""
    folders = add_search_path([*search_path, Path.cwd()])
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and module != err.name and not module.startswith(f"{err.name}."):
            # the module exists but imports something missing
            why = f"importing module {module!r} failed: it imports {err.name!r}, which is not installed"
        else:
            why = (
                f"no module named {module!r} (looked in {_where(folders)} and the installed packages); put "
                f"{module.split('.')[0]}.py next to the config file or in the working directory, or install it"
            )
    except Exception as err:  # a user's module may raise anything while it is imported
        why = f"importing module {module!r} failed: {type(err).__name__}: {err}"
    FAILED_IMPORTS[module] = why
    raise PluginError(field, why)


def import_object(spec: str, field: str, search_path: Sequence[str | Path] = ()) -> Any:
    """The object ``spec = "MODULE:NAME"`` names (``NAME`` may be dotted: ``mod:Outer.inner``), for the
    config ``field``. ``search_path``: folders to look in first (e.g. the config file's folder); the
    working directory is always searched. Raises :class:`PluginError` (a ``ValueError``) whose message
    starts with ``field`` and says how to fix the spec."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(part.strip() for part in spec.split(":")):
        raise PluginError(
            field,
            f"{spec!r} is not MODULE:NAME; write the module and the name, e.g. my_envs:CopyEnv or my_algos:my_loss",
        )
    module_name, attr = (part.strip() for part in spec.split(":"))
    module = import_module(module_name, field, search_path)
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = module_name if i == 0 else f"{module_name}:{'.'.join(attr.split('.')[:i])}"
            public = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, public, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; it defines {public[:12]}"
            src = getattr(module, "__file__", None)
            raise PluginError(field, f"{owner} ({src}) has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    return obj


def closest_hint(value: str, known: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` naming the known name closest to ``value``, or ``""`` when none is close."""
    close = difflib.get_close_matches(value, list(known), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def lookup(
    value: str, registry: Mapping[str, Any], field: str, kind: str, search_path: Sequence[str | Path] = ()
) -> Any:
    """``registry[value]`` for a registered name, or the object of a ``MODULE:NAME`` spec; an unknown
    name raises :class:`PluginError` listing the registered names (and the closest one)."""
    if is_spec(value):
        return import_object(value, field, search_path)
    if value in registry:
        return registry[value]
    hint = closest_hint(value, registry)
    raise PluginError(
        field,
        f"unknown {kind} {value!r}; {hint}registered: {', '.join(sorted(registry))} — or name your own as "
        f"MODULE:NAME (a module next to the config), or register it by name in a module listed under plugins:",
    )


def _type_problem(annotation: Any, value: Any) -> str | None:
    """The pydantic message when ``value`` does not fit ``annotation``; None when it fits or when the
    annotation cannot be checked."""
    from pydantic import TypeAdapter, ValidationError

    try:
        adapter: TypeAdapter[Any] = TypeAdapter(annotation)
    except Exception:
        return None
    try:
        adapter.validate_python(value)
    except ValidationError as err:
        return err.errors()[0]["msg"]
    return None


def signature_problems(
    fn: Callable[..., Any],
    kwargs: Mapping[str, Any],
    *,
    leading: Sequence[Any] = (),
    fixed: Mapping[str, Any] | None = None,
) -> list[str]:
    """What is wrong with calling ``fn(*leading, **fixed, **kwargs)``, judged from its signature alone:
    unknown or missing arguments and values that do not fit an argument's annotation (checked with
    pydantic where the annotation allows it). ``leading`` / ``fixed`` are what the framework passes;
    the problems are about ``kwargs`` (the config's part). Empty when the call would bind."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []  # a builtin without a signature: nothing to check
    fixed = dict(fixed or {})
    params = sig.parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY) and n not in fixed
    ][len(leading) :]
    problems = []
    if not accepts_any:
        for key in kwargs:
            if key not in params or key in fixed or key not in named:
                close = difflib.get_close_matches(key, named, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(f"unknown argument {key!r}{hint}; accepted: {named}")
    try:
        sig.bind(*leading, **fixed, **{k: v for k, v in kwargs.items() if k in named or accepts_any})
    except TypeError as err:
        if not problems:
            problems.append(f"{err}; accepted: {named}")
    try:
        target = fn
        if isinstance(fn, type):  # a class: its (possibly inherited) __init__'s annotations
            target = next((vars(c)["__init__"] for c in fn.__mro__ if "__init__" in vars(c)), fn)
        # only the given arguments' annotations: the others may name torch, which a config check never imports
        given = {k: v for k, v in getattr(target, "__annotations__", {}).items() if k in kwargs}
        globalns = getattr(target, "__globals__", None)
        hints = typing.get_type_hints(types.SimpleNamespace(__annotations__=given), globalns=globalns) if given else {}
    except Exception:
        hints = {}
    for key, value in kwargs.items():
        if key in hints and key in named:
            msg = _type_problem(hints[key], value)
            if msg is not None:
                problems.append(f"{key}={value!r}: {msg}")
    return problems


class PipelineLike(Protocol):
    """The entry points ``rollart run`` uses, which a ``pipeline: MODULE:CLASS`` must provide (a
    subclass of :class:`rollart.pipelines.agentic.AgenticPipeline` has them):

    - ``Pipeline(config, *, resume=False, progress=True)`` builds it from the validated config (a
      :class:`~rollart.config.PipelineConfig`; this module sits below the config and names no type of
      it) — clusters may start here;
    - ``run() -> list[dict]`` trains, returning one metrics record per step (``reward_mean`` read by
      the summary when present);
    - ``shutdown()`` releases what it started (called even when ``run`` raised);
    - ``metrics_path`` / ``plot_path`` (optional attributes) go into ``rollart run --json``'s summary.
    """

    def __init__(self, config: Any, *, resume: bool = False, progress: bool = True) -> None: ...

    def run(self) -> list[dict[str, Any]]: ...

    def shutdown(self) -> None: ...


def check_pipeline_class(cls: Any, field: str = "pipeline") -> type[PipelineLike]:
    """``cls`` when it is a class with :class:`PipelineLike`'s entry points; else :class:`PluginError`
    naming what is missing."""
    if not isinstance(cls, type):
        raise PluginError(field, f"{cls!r} is not a class; name a pipeline class (a subclass of AgenticPipeline)")
    missing = [m for m in ("run", "shutdown") if not callable(getattr(cls, m, None))]
    if missing:
        raise PluginError(
            field,
            f"{cls.__module__}.{cls.__qualname__} has no {' and no '.join(f'{m}()' for m in missing)} method; a "
            "pipeline needs run() -> list[dict] and shutdown() (subclass rollart.pipelines.agentic.AgenticPipeline)",
        )
    try:
        inspect.signature(cls).bind(object(), resume=False, progress=False)
    except TypeError as err:
        raise PluginError(
            field,
            f"{cls.__module__}.{cls.__qualname__}(config, resume=..., progress=...) cannot be called ({err}); "
            "its __init__ must take (config, *, resume=False, progress=True)",
        ) from None
    except ValueError:
        pass  # no signature to read
    return cls
