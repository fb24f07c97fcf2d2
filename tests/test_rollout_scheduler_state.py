"""The rollout scheduler owns its checkpoint state: ``state_dict()`` / ``load_state_dict()`` round-trip,
and a resumed scheduler plays the same rounds next as the one it was saved from (no Ray, no model)."""

import asyncio
import json

import pytest

from rollart.rollout.config import RolloutConfig
from rollart.rollout.sample_buffer import Group
from rollart.rollout.scheduler import RolloutScheduler
from rollart.rollout.types import GroupId, Trajectory


class FakeManager:
    """Plays an episode instantly: reward = the seed's parity (so groups have no variance)."""

    def __init__(self, started: list[tuple[int, int]]):
        self.started = started

    async def run(self, seed, group_id, traj_id):
        g, r = (int(x) for x in group_id.split(":"))
        if traj_id.split(":")[2] == "0":  # member 0 records the round once
            self.started.append((g, r))
        await asyncio.sleep(0)
        return Trajectory(traj_id=traj_id, group_id=group_id, tag="fake", reward=float(seed % 2))

    async def abort(self):
        return None


def make(cfg: RolloutConfig) -> tuple[RolloutScheduler, list[tuple[int, int]]]:
    started: list[tuple[int, int]] = []
    groups = [[FakeManager(started) for _ in range(cfg.group_size)] for _ in range(cfg.num_env_groups)]
    return RolloutScheduler(groups, cfg), started


def test_group_ids_are_typed_and_print_as_before():
    gid = GroupId(3, 17)
    assert str(gid) == "3:17" and gid.env_group == 3 and gid.round == 17
    grp = Group([Trajectory(traj_id="a", group_id=str(gid), tag="t")], gid)
    assert grp.gid == gid and len(grp) == 1 and isinstance(grp, list)
    import pickle

    again = pickle.loads(pickle.dumps(grp))
    assert again.gid == gid and again == grp


async def test_state_dict_round_trips_and_a_resumed_scheduler_plays_the_same_rounds_next():
    cfg = RolloutConfig(num_env_groups=3, group_size=2, batch_groups=2, alpha=1)
    sched, _ = make(cfg)
    sched.start()
    try:
        for _ in range(2):
            batch = await asyncio.wait_for(sched.get_batch(), timeout=30)
            assert all(isinstance(g.gid, GroupId) and str(g.gid) == g[0].group_id for g in batch)
            await sched.set_version(sched.version + 1)
        trained = {g.gid for g in batch}
    finally:
        await sched.stop()
    state = sched.state_dict()
    # rounds generated but not trained on are replayed first; nothing trained is replayed
    pending = {(g, r) for g, rounds in state["retry"].items() for r in rounds}
    assert pending and not pending & {tuple(t) for t in trained}
    assert json.loads(json.dumps(state)) == {**state, "retry": {str(k): v for k, v in state["retry"].items()}}

    # two fresh schedulers loaded from the same state (one through JSON) start the same rounds
    plays = []
    for loaded in (state, json.loads(json.dumps(state))):
        resumed, started = make(cfg)
        resumed.load_state_dict(loaded)
        assert resumed.state_dict() == state
        resumed.start()
        try:
            await asyncio.wait_for(resumed.get_batch(), timeout=30)
        finally:
            await resumed.stop()
        plays.append(started)
    assert plays[0] == plays[1]
    first_of_each = {}
    for g, r in plays[0]:
        first_of_each.setdefault(g, r)
    for g in range(cfg.num_env_groups):  # each group replays its oldest pending round, else its next new one
        expected = min(state["retry"][g]) if state["retry"].get(g) else state["next_round"][g]
        assert first_of_each[g] == expected


def test_load_state_dict_refuses_a_different_number_of_groups():
    sched, _ = make(RolloutConfig(num_env_groups=2, group_size=1, batch_groups=1))
    with pytest.raises(ValueError, match="num_env_groups=2"):
        sched.load_state_dict({"num_env_groups": 3, "next_round": [0, 0, 0], "retry": {}, "counts": {}})
