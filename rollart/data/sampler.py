"""Which prompt each rollout round plays: epochs shuffled with the run seed, every prompt once per epoch.

The scheduler gives round ``r`` of env group ``g`` the reset seed :meth:`RoundSeeds.seed` ``(g, r)``,
and replays a round with the same seed (retries, rounds aborted for staleness, rounds still in flight
at a checkpoint). A dataset task played by ``G`` env groups turns the seed back into ``(g, r)`` and
plays *position* ``r * G + k`` (``k``: the group's index within the task), so positions
``0, 1, 2, …`` are each played by exactly one round, in round order. Position ``p`` is row
``perm_e[p % N]`` of epoch ``e = p // N``, ``perm_e`` a permutation of the ``N`` rows drawn from the run
seed and ``e``. A replayed round replays its prompt, and a resumed run (the scheduler's checkpoint
holds every group's next round) continues at the positions where it stopped.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

GROUP_STRIDE = 100_003


class RoundSeeds:
    """The reset seed of round ``r`` of env group ``g`` for a run seed, and back."""

    def __init__(self, run_seed: int):
        self.base = run_seed * 7919

    def seed(self, group: int, round_index: int) -> int:
        return self.base + group * GROUP_STRIDE + round_index

    def round(self, group: int, seed: int) -> int:
        return seed - self.base - group * GROUP_STRIDE


class EpochSampler:
    """Maps a position to a row index: ``shuffle`` permutes each epoch (seeded by ``seed`` and the epoch),
    else positions go through the rows in order. Records how far it has been asked (``next_position``),
    the progress it reports and checkpoints."""

    def __init__(self, size: int, seed: int = 0, *, shuffle: bool = True):
        if size < 1:
            raise ValueError(f"EpochSampler: size must be >= 1, got {size}")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.next_position = 0
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = list(range(self.size))
            random.Random(f"rollart-data:{self.seed}:{epoch}").shuffle(perm)
            if len(self._perms) >= 2:  # rounds straddle at most an epoch boundary
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def index(self, position: int) -> int:
        """The row played at ``position`` (>= 0)."""
        if position < 0:
            raise ValueError(f"EpochSampler: position must be >= 0, got {position}")
        self.next_position = max(self.next_position, position + 1)
        if not self.shuffle:
            return position % self.size
        epoch, offset = divmod(position, self.size)
        return self._perm(epoch)[offset]

    @property
    def epoch(self) -> float:
        """Epochs started so far, fractional (1.5: half-way through the second pass)."""
        return self.next_position / self.size

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "seed": self.seed, "shuffle": self.shuffle, "next_position": self.next_position}

    def load_state_dict(self, state: Mapping[str, Any], *, what: str = "data") -> None:
        """Restore :meth:`state_dict`; a checkpoint of another dataset size or seed is refused (its
        positions would map to other prompts)."""
        if int(state["size"]) != self.size or int(state["seed"]) != self.seed:
            raise ValueError(
                f"--resume: {what} has {self.size} rows and seed {self.seed}, the checkpoint's sampler "
                f"{state['size']} rows and seed {state['seed']}; resume with the data and seed it was trained with"
            )
        self.next_position = int(state["next_position"])
