"""Wire schemas of the reward service (published in its OpenAPI document)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class TrajectoryIn(BaseModel):
    """One trajectory to score. ``response`` is what the policy answered; ``ground_truth`` whatever the
    reward function compares against."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = ""
    response: str
    ground_truth: Any = None
    tag: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trajectories: list[TrajectoryIn] = Field(min_length=1, max_length=4096)


class RewardResponse(BaseModel):
    result: list[float]
    details: list[dict[str, Any]]
