"""Env lookup by name: the built-in envs and those added with :func:`~rollart.envs.base.register_env`
(:func:`registered_envs`, :func:`env_class`), a user's ``MODULE:CLASS``, and :func:`make_env`. The
built-in env modules are imported on the first lookup; each registers itself with ``register_env``."""

from __future__ import annotations

import difflib
import inspect
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
