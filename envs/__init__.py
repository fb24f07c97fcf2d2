"""Environments: a text env interface and registry, single-turn verifiable tasks (reverse, addition,
countdown), FrozenLake, Sokoban, a tokenizer corpus and fault-injection wrappers."""

from rollart.envs.base import EnvError, EnvSpec, EnvTimeout, TextEnv, register_env
from rollart.envs.registry import declared_tag, env_class, env_kwargs_problems, make_env, registered_envs

__all__ = [
    "EnvError",
    "EnvSpec",
    "EnvTimeout",
    "TextEnv",
    "declared_tag",
    "env_class",
    "env_kwargs_problems",
    "make_env",
    "register_env",
    "registered_envs",
]
