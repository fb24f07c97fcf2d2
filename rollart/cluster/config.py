"""``fault:`` of a pipeline config (pydantic only): one :class:`RestartPolicy` per role
(:class:`FaultConfig`); :mod:`rollart.cluster.fault` applies them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rollart.config_model import ConfigModel

TRAINER_ROLES = ("train", "reference", "critic")


class RestartPolicy(ConfigModel):
    """How often a role's dead workers are restarted, and what happens when that is spent."""

    max_restarts: int = Field(default=2, ge=0)
    """Restarts per worker (rank) within `window_s`."""
    window_s: float = Field(default=300.0, gt=0)
    """Restarts older than this many seconds no longer count."""
    backoff_s: float = Field(default=1.0, ge=0)
    """Seconds waited before each restart (doubles with each restart in the window)."""
    on_exhausted: Literal["remove", "fail"] = "remove"
    """When the restarts are spent: `remove` drops the worker from its pool, `fail` fails the job with the cause
    (the only choice for train, reference and critic).
    """


REMOVED_ROLES = {
    "env": "env faults are handled by the EnvManager's retries and timeouts (env_manager.reset_retries, "
    "step_retries, reset_timeout_s, step_timeout_s), and the env servers of backend: ray are restarted by Ray",
    "reward": "the reward service is a server of its own (rollart serve rewards) that the pipeline does not start; "
    "a failing request is retried by the reward client (reward.retries, reward.timeout_s) and a reward that "
    "still fails is handled by reward.on_failure, never scored 0",
}


class FaultConfig(ConfigModel):
    """``fault:`` — one restart policy per role that rollart restarts itself (``inference``, ``train``,
    ``reference``, ``critic``). ``env`` and ``reward`` are refused: rollart does not restart those
    processes, and a policy that does nothing would be a trap."""

    inference: RestartPolicy = Field(default_factory=RestartPolicy)
    """Restart policy of the inference workers."""
    train: RestartPolicy = Field(default_factory=lambda: RestartPolicy(max_restarts=0, on_exhausted="fail"))
    """Restart policy of the trainer ranks (a dead rank rebuilds every rank from the latest checkpoint)."""
    reference: RestartPolicy = Field(default_factory=lambda: RestartPolicy(max_restarts=0, on_exhausted="fail"))
    """Restart policy of the reference ranks."""
    critic: RestartPolicy = Field(default_factory=lambda: RestartPolicy(max_restarts=0, on_exhausted="fail"))
    """Restart policy of the critic ranks."""

    @model_validator(mode="before")
    @classmethod
    def _gang_roles_fail_by_default(cls, data: Any) -> Any:
        """``train: {max_restarts: 1}`` keeps ``on_exhausted: fail`` (the only choice for those roles);
        ``env`` and ``reward`` are refused with what handles their faults instead."""
        if isinstance(data, dict):
            for role, instead in REMOVED_ROLES.items():
                if role in data:
                    raise ValueError(
                        f"fault.{role}: rollart does not restart {role} processes, so a restart policy for them "
                        f"would do nothing; remove fault.{role} ({instead})"
                    )
            data = dict(data)
            for role in TRAINER_ROLES:
                given = data.get(role)
                if isinstance(given, dict) and "on_exhausted" not in given:
                    data[role] = {**given, "on_exhausted": "fail"}
        return data

    @model_validator(mode="after")
    def _gang_roles_cannot_shrink(self) -> FaultConfig:
        for role in TRAINER_ROLES:
            if getattr(self, role).on_exhausted == "remove":
                raise ValueError(
                    f"fault.{role}.on_exhausted: 'remove' is not possible for {role} (a data-parallel group "
                    "cannot go on without one of its ranks); use 'fail'"
                )
        return self
