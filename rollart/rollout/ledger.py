"""Which rounds of each env group are settled, kept compactly (issue #13, bounded driver memory).

A round is settled once it can never be trained on again: it was handed to the trainer, dropped by
dynamic filtering, or given up after repeated failures. Rounds of one group settle almost in order
(only rounds retried after a staleness abort or a failure overtake each other), so each group keeps a
watermark (every round below it is settled) and the small set of settled rounds above it. The set
holds at most the rounds that were unsettled at one time — bounded by the scheduler's admission
control — whatever the number of steps; the state in a checkpoint is that size too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class RoundLedger:
    """Settled rounds per env group: a watermark plus the settled rounds above it."""

    def __init__(self, num_groups: int):
        self.watermark = [0] * num_groups
        self.above: list[set[int]] = [set() for _ in range(num_groups)]

    def settle(self, group: int, round_: int) -> bool:
        """Mark ``(group, round_)`` settled; False when it already was (a round is never counted twice)."""
        if (group, round_) in self:
            return False
        above = self.above[group]
        above.add(round_)
        w = self.watermark[group]
        while w in above:
            above.remove(w)
            w += 1
        self.watermark[group] = w
        return True

    def __contains__(self, gid: object) -> bool:
        if not isinstance(gid, tuple) or len(gid) != 2:
            return False
        group, round_ = int(gid[0]), int(gid[1])
        return round_ < self.watermark[group] or round_ in self.above[group]

    def settled(self) -> int:
        """How many rounds are settled in all."""
        return sum(self.watermark) + sum(len(a) for a in self.above)

    def size(self) -> int:
        """Entries held (watermarks + rounds above them): what memory and checkpoints grow with."""
        return len(self.watermark) + sum(len(a) for a in self.above)

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and lists (``torch.load(weights_only=True)`` and JSON can read it)."""
        return {"watermark": list(self.watermark), "above": [sorted(a) for a in self.above]}

    def load_state_dict(self, state: Mapping[str, Any] | Iterable[str]) -> None:
        """Restore :meth:`state_dict`; a list of trajectory ids ``"g:r:..."`` (older checkpoints) also works."""
        n = len(self.watermark)
        self.watermark = [0] * n
        self.above = [set() for _ in range(n)]
        if isinstance(state, Mapping):
            if len(state["watermark"]) != n:
                raise ValueError(
                    f"consumed-rounds state has {len(state['watermark'])} env groups but the rollout has {n}; "
                    "resume with the configuration the checkpoint was written with"
                )
            self.watermark = [int(w) for w in state["watermark"]]
            self.above = [{int(r) for r in a} for a in state["above"]]
            return
        for traj_id in state:
            g, r = str(traj_id).split(":")[:2]
            self.settle(int(g), int(r))


def trajectory_ledger(counts: Mapping[str, int], *, buffered: int, in_flight: int) -> dict[str, int]:
    """Where every trajectory started went, from the scheduler's counters (each kept on its own path).

    ``started = trained + retried + failed + filtered + buffered + in_flight + lost``:

    * ``trained``: handed to the trainer;
    * ``retried``: not trained and its seed played again or completed without it — aborted (stale
      round, stop), dropped (its round aborted or failed, or a redundant member past ``group_keep``),
      evicted from the buffer as stale, or started before the checkpoint a run resumed from and played
      again after it (a trajectory whose request moved to another worker is *not* here: it resumes and
      ends normally; the proxy's ``faults.migrated`` counts those);
    * ``failed``: reported failed with the cause (env error or timeout, generation error, reward
      service failure) — never scored;
    * ``filtered``: dynamic filtering dropped its group (all rewards equal);
    * ``buffered`` / ``in_flight``: generated and waiting for the trainer / still running.

    ``lost`` is what none of these accounts for; it must be 0. While the rollout runs a trajectory of a
    round that is being completed is briefly in none of them, so ``lost`` is exact only after
    ``RolloutScheduler.stop``. ``trained_twice`` counts rounds handed to the trainer twice (the
    :class:`RoundLedger`: trajectory ids carry their round, ``"group:round:member:vN"``, and a round is
    trained as one group, so a trajectory trained twice means a round settled twice — checked with
    memory bounded by the unsettled rounds instead of a set of every id).
    """
    c = counts
    started = int(c.get("trajectories_started", 0))
    trained = int(c.get("trajectories_trained", 0))
    retried = sum(
        int(c.get(k, 0))
        for k in (
            "trajectories_aborted",
            "trajectories_dropped",
            "trajectories_evicted",
            "trajectories_replayed_on_resume",
        )
    )
    failed = int(c.get("trajectories_failed", 0)) + int(c.get("trajectories_reward_failed", 0))
    filtered = int(c.get("trajectories_filtered", 0))
    return {
        "started": started,
        "trained": trained,
        "retried": retried,
        "failed": failed,
        "filtered": filtered,
        "buffered": buffered,
        "in_flight": in_flight,
        "lost": started - trained - retried - failed - filtered - buffered - in_flight,
        "trained_twice": int(c.get("rounds_trained_twice", 0)),
        # trained, then undone by a trainer restore to an earlier checkpoint (their rounds played again)
        "rolled_back": int(c.get("trajectories_rolled_back", 0)),
    }
