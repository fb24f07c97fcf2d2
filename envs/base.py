"""The text environment interface (gymnasium-style) and the env registry.

``reset(seed) -> (observation, info)``; ``step(action) -> (observation, reward, terminated,
truncated, info)``. Every env has a routing ``tag``, ``max_steps`` and ``max_new_tokens``. Faults are
``EnvError`` / ``EnvTimeout``; the EnvManager retries resets and ends a trajectory whose step keeps
failing as ``failed``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field


class EnvError(RuntimeError):
    """An environment could not reset or step."""


class EnvTimeout(EnvError):
    """An environment call took longer than allowed."""


class TextEnv(ABC):
    tag: ClassVar[str] = "env"
    max_steps: int = 1
    max_new_tokens: int = 16

    @abstractmethod
    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]: ...

    @abstractmethod
    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]: ...

    def close(self) -> None:
        return None


class EnvSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    tag: str | None = None
    max_steps: int | None = None
    max_new_tokens: int | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)


_REGISTRY: dict[str, type[TextEnv]] = {}
E = TypeVar("E", bound=type[TextEnv])


def register_env(name: str) -> Callable[[E], E]:
    def add(cls: E) -> E:
        _REGISTRY[name] = cls
        return cls

    return add


def registered_envs() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    import envs.verifiable  # noqa: F401  (registers the built-in tasks)

    try:
        import envs.frozen_lake  # noqa: F401
        import envs.sokoban  # noqa: F401
    except ImportError:
        pass


def make_env(spec: EnvSpec | str, **kwargs: Any) -> TextEnv:
    """Build an env by registry name (``reverse``, ``addition``, ``countdown``, ``frozen_lake``, ...)."""
    _load_builtin()
    if isinstance(spec, str):
        spec = EnvSpec(name=spec, kwargs=kwargs)
    if spec.name not in _REGISTRY:
        raise ValueError(f"env name {spec.name!r} is not registered; known: {sorted(_REGISTRY)}")
    env = _REGISTRY[spec.name](**spec.kwargs)
    if spec.tag is not None:
        env.tag = spec.tag  # type: ignore[misc]
    if spec.max_steps is not None:
        env.max_steps = spec.max_steps
    if spec.max_new_tokens is not None:
        env.max_new_tokens = spec.max_new_tokens
    return env
