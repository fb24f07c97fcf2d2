"""Env lookup by name: the built-in envs and those added with :func:`~rollart.envs.base.register_env`
(:func:`registered_envs`, :func:`env_class`), a user's ``MODULE:CLASS``, the tag a class declares
(:func:`declared_tag`, read without building an env), and :func:`make_env`. The built-in env modules are
imported on the first lookup; each registers itself with ``register_env``."""

from __future__ import annotations

import ast
import difflib
import functools
import inspect
import textwrap
from collections.abc import Mapping
from typing import Any

from rollart.envs.base import _REGISTRY, EnvSpec, TextEnv


def registered_envs() -> list[str]:
    """Names accepted by :func:`make_env`."""
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    import rollart.envs.code_sandbox
    import rollart.envs.frozen_lake
    import rollart.envs.sokoban
    import rollart.envs.verifiable  # noqa: F401


def env_class(name: str, field: str = "envs[].name") -> type[TextEnv]:
    """The env class of a registry ``name`` or of ``MODULE:CLASS`` (a user's :class:`TextEnv` subclass,
    imported as :func:`rollart.plugins.import_object` does; it need not be registered). Raises
    ``ValueError`` naming ``field``."""
    from rollart.plugins import PluginError, import_object

    if ":" in name:
        cls = import_object(name, field)
        if not (isinstance(cls, type) and issubclass(cls, TextEnv)):
            raise PluginError(
                field,
                f"{name} is {cls!r}, not a TextEnv subclass; an env class derives from rollart.envs.TextEnv "
                "and defines reset(seed) and step(action)",
            )
        return cls
    _load_builtin()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise PluginError(
            field,
            f"env name {name!r} is not registered; {hint}known: {sorted(_REGISTRY)} — or name your own class as "
            "MODULE:CLASS (e.g. my_envs:CopyEnv, with my_envs.py next to the config)",
        )
    return _REGISTRY[name]


def env_kwargs_problems(cls: type[TextEnv], kwargs: dict[str, Any]) -> list[str]:
    """What is wrong with ``cls(**kwargs)`` judged from the constructor's signature: unknown or missing
    arguments, values that do not fit an annotation. Empty when it would bind."""
    from rollart.plugins import signature_problems

    if cls.__init__ is object.__init__:
        return [f"unknown argument {k!r}; {cls.__name__}() takes no arguments" for k in kwargs]
    return signature_problems(cls, kwargs)


def declared_tag(cls: type[TextEnv], kwargs: Mapping[str, Any]) -> str | None:
    """The tag of an env of ``cls`` built with ``kwargs``, read from the class without building it:
    :meth:`TextEnv.tag_for <rollart.envs.base.TextEnv.tag_for>` of the constructor's arguments (defaults
    filled in), by default the class attribute ``tag``. None when the class sets its tag when it is built:
    its ``__init__``, or that of a base class below the nearest one that declares ``tag_for``, assigns
    ``self.tag``. Raises ``ValueError`` when ``tag_for`` fails."""
    for owner in cls.__mro__:
        if owner is TextEnv or "tag_for" in owner.__dict__:
            break
        if _init_sets_tag(owner):
            return None
    arguments = _arguments(cls, kwargs)
    try:
        return str(cls.tag_for(arguments))
    except Exception as err:
        raise ValueError(f"its tag_for({arguments}) raised {type(err).__name__}: {err}") from None


def _arguments(cls: type[TextEnv], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the defaults of the constructor's other parameters (what a ``**kwargs`` parameter
    takes stays flat); ``kwargs`` as given where they do not bind."""
    try:
        signature = inspect.signature(cls)
        bound = signature.bind_partial(**kwargs)
    except (TypeError, ValueError):
        return dict(kwargs)
    bound.apply_defaults()
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            out[name] = value
    return out


@functools.cache
def _init_sets_tag(cls: type) -> bool:
    """Whether ``cls``'s own ``__init__`` assigns ``self.tag`` (read from its source; False without one)."""
    init = cls.__dict__.get("__init__")
    if init is None:
        return False
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(init))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):  # no source: where the env is built its tag is checked
        return False
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
        return False
    me = fn.args.args[0].arg

    def is_me(node: ast.expr) -> bool:
        return isinstance(node, ast.Name) and node.id == me

    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr == "tag":
            if is_me(node.value):  # self.tag = ..., self.tag: str = ..., self.a, self.tag = ...
                return True
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            args = node.args
            if len(args) >= 2 and is_me(args[0]) and isinstance(args[1], ast.Constant) and args[1].value == "tag":
                return True
    return False


def make_env(spec: EnvSpec | dict[str, Any] | str, **kwargs: Any) -> TextEnv:
    """Build an env by registry name (``reverse``, ``addition``, ``countdown``, ``frozen_lake``,
    ``sokoban``, ``code_sandbox``, or one added with :func:`register_env`) or as ``MODULE:CLASS``. ``kwargs`` go to the
    env's constructor (on top of ``spec.kwargs``); the spec's ``tag``/``max_steps``/``max_new_tokens``
    override the env's."""
    if isinstance(spec, str):
        spec = EnvSpec(name=spec)
    elif isinstance(spec, dict):
        spec = EnvSpec.model_validate(spec)
    cls = env_class(spec.name, "env")
    params = {**spec.kwargs, **kwargs}
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(params) - set(accepted))
    if unknown and not any(
        inspect.signature(cls.__init__).parameters[p].kind == inspect.Parameter.VAR_KEYWORD for p in accepted
    ):
        raise ValueError(f"env {spec.name!r}: unknown kwargs {unknown}; accepted: {accepted}")
    env = cls(**params)
    if spec.tag is not None:
        env.tag = spec.tag  # type: ignore[misc]
    if spec.max_steps is not None:
        env.max_steps = spec.max_steps
    if spec.max_new_tokens is not None:
        env.max_new_tokens = spec.max_new_tokens
    return env
