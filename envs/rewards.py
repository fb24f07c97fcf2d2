"""Reward functions of the built-in verifiable tasks, for the reward service:
``rollart serve rewards rollart.envs.rewards:reverse``. Each takes a trajectory dict (``response``,
``ground_truth``) and scores it with the task's own verifier, so the service and the in-process env agree.
"""

from __future__ import annotations

from typing import Any

from rollart.envs.addition import AdditionTask
from rollart.envs.countdown import CountdownTask
from rollart.envs.reverse import ReverseTask


def reverse(trajectory: dict[str, Any]) -> float:
    return ReverseTask.verify(trajectory["response"], trajectory["ground_truth"])


def addition(trajectory: dict[str, Any]) -> float:
    return AdditionTask.verify(trajectory["response"], trajectory["ground_truth"])


def countdown(trajectory: dict[str, Any]) -> float:
    return CountdownTask.verify(trajectory["response"], trajectory["ground_truth"])
