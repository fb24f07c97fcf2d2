"""Errors a reward function raises to say what the caller did wrong (answered as 422, not 500)."""

from __future__ import annotations


class RewardInputError(ValueError):
    """The trajectory asks for something the server refuses (the reward service answers 422 with the
    message); any other exception is the function's own failure (500)."""
