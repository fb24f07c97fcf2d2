"""The text environment interface (gymnasium-style) and the env registry's store (RollArt paper §5.3, seed
000 §5.2); lookup by name is :mod:`rollart.envs.registry`.

``reset(seed) -> (observation, info)``; ``step(action) -> (observation, reward, terminated,
truncated, info)``. Every env has a routing ``tag`` (the LLMProxy routes its generation requests by
it), ``max_steps`` (after that many steps an episode that has not terminated is *truncated*) and
``max_new_tokens`` (the generation budget of one action). Envs are deterministic given the reset seed.

Faults are :class:`EnvError` / :class:`EnvTimeout`: the EnvManager retries resets and ends a
trajectory whose step keeps failing as ``failed``; an env never turns a fault into a reward.
An unreadable action is not a fault: it costs a format penalty and returns an "invalid action"
observation, so the agent can learn the format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field

StepResult = tuple[str, float, bool, bool, dict[str, Any]]


class EnvError(RuntimeError):
    """An environment could not reset or step."""


class EnvTimeout(EnvError):
    """An environment call took longer than allowed."""


class TextEnv(ABC):
    """A text environment. Subclasses set ``tag``, ``max_steps``, ``max_new_tokens`` and
    ``instructions`` (the task description an agent needs to play it; see :meth:`format_prompt`).

    The tag is declared by the class, so a config reads it without building an env: the class attribute
    ``tag``, or :meth:`tag_for` where it depends on the constructor's arguments. An ``__init__`` that sets
    ``self.tag`` in a class that does not declare ``tag_for`` makes the tag known only once the env is
    built: a config that needs it (``tasks:``) then asks for ``envs[i].tag``."""

    tag: ClassVar[str] = "env"
    instructions: ClassVar[str] = ""
    max_steps: int = 1
    max_new_tokens: int = 16
    inline_methods: frozenset[str] = frozenset()
    """The methods (``reset``, ``step``) that are quick, non-blocking Python: the EnvManager calls them on
    the rollout's event loop instead of in a worker thread, which saves a thread hop per call (on the
    throughput bench, running them inline cut the rollout wait by about 30% on a busy 2-core machine).
    Their timeouts cannot interrupt them, so leave a method out when it does I/O, sleeps, or may hang: it
    then runs in a thread, bounded by ``env_manager.reset_timeout_s`` / ``step_timeout_s``. Read from the
    class, or from the instance's own ``__dict__`` (a wrapper that forwards attributes never passes on its
    inner env's)."""

    kwarg_limits: ClassVar[dict[str, tuple[float, float]]] = {}
    """The range ``(low, high)`` each numeric constructor argument named here may take when the env is
    served to clients (``rollart serve env``): the env server refuses a session whose kwargs fall outside
    it (422) before building anything, so a client cannot make it build a huge env. Configs run locally
    are not bound by it."""

    @classmethod
    def tag_for(cls, kwargs: Mapping[str, Any]) -> str:
        """The tag of an env of this class built with ``kwargs`` (every argument of the constructor, its
        defaults filled in), read without building it: the class attribute ``tag`` here. A class whose tag
        depends on its arguments overrides this and its ``__init__`` sets the same (``reverse``:
        ``reverse-{length}``); where an env is built, a tag other than this one is refused."""
        return cls.tag

    @abstractmethod
    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode; the same seed gives the same episode. Returns ``(observation, info)``."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the agent's action text. Returns ``(observation, reward, terminated, truncated, info)``."""

    def format_prompt(self, observation: str) -> str:
        """The observation preceded by this env's instructions (for agents that need to be told the
        task; the built-in tiny model is trained without them)."""
        return f"{self.instructions}\n{observation}" if self.instructions else observation

    def close(self) -> None:
        """Release what the env holds (processes, sockets); the default holds nothing."""
        return None


def check_positive(owner: str, **values: float) -> None:
    """Raise ``ValueError`` naming the first field that is not ``>= 1``."""
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{owner}: {name} must be >= 1, got {value!r}")


class EnvSpec(BaseModel):
    """An env as written in a YAML config: registry ``name``, constructor ``kwargs`` and optional
    overrides of ``tag``, ``max_steps`` and ``max_new_tokens``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    tag: str | None = None
    max_steps: int | None = Field(default=None, ge=1)
    max_new_tokens: int | None = Field(default=None, ge=1)
    kwargs: dict[str, Any] = Field(default_factory=dict)


_REGISTRY: dict[str, type[TextEnv]] = {}
E = TypeVar("E", bound=type[TextEnv])


def register_env(name: str) -> Callable[[E], E]:
    """Class decorator: make ``cls`` buildable as ``make_env(name, **kwargs)``."""

    def add(cls: E) -> E:
        if not (isinstance(cls, type) and issubclass(cls, TextEnv)):
            raise TypeError(f"register_env({name!r}) needs a TextEnv subclass, got {cls!r}")
        old = _REGISTRY.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(
                f"env name {name!r} is already registered to {old.__module__}.{old.__qualname__}; pick another name"
            )
        _REGISTRY[name] = cls
        return cls

    return add
