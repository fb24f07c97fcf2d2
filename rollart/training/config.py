"""Training configuration (pydantic)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class TrainConfig(BaseModel):
    """How the torch strategy trains the actor. ``model`` is a Hugging Face folder (default: the
    built-in tiny model); ``loss`` names a policy loss of ``rollart.algorithms`` with ``loss_params``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    lr: float = Field(default=1e-3, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(default=0, ge=0)
    grad_clip: float | None = 1.0
    max_tokens_per_microbatch: int = Field(default=16384, gt=0)
    loss: str = "ppo"
    loss_params: dict[str, Any] = Field(default_factory=dict)
    loss_agg: str = "token-mean"
    tis_cap: float | None = None  # train/inference mismatch truncated IS (seed 000 eq. 12)
    kl_coef: float = Field(default=0.0, ge=0)
    entropy_coef: float = Field(default=0.0, ge=0)  # loss -= coef * mean entropy of the action tokens
    kl_kind: Literal["k1", "k2", "k3", "abs"] = "k3"
    ppo_epochs: int = Field(default=1, ge=1)
    seed: int = 0
    backend: Literal["auto", "gloo", "nccl"] = "auto"
