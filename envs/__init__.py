"""Environments: a text env interface, single-turn verifiable tasks, FrozenLake, Sokoban."""

from envs.base import EnvError, EnvSpec, EnvTimeout, TextEnv, make_env, register_env, registered_envs

__all__ = ["EnvError", "EnvSpec", "EnvTimeout", "TextEnv", "make_env", "register_env", "registered_envs"]
