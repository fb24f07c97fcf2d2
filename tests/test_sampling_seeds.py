"""Seeded sampling: with ``sampling.seed`` set, every request of an EnvManager carries its own seed,
derived from the run's seed, the env seed, the trajectory id and the turn, so what a trajectory samples
does not depend on how the engine batched it (a seeded pipeline run repeats); members of a group and
turns of a trajectory get different seeds."""

import asyncio
from types import SimpleNamespace

from rollout_fixtures import CharCodec, CountEnv

from rollart.engines.base import SamplingParams
from rollart.rollout.env_manager import EnvManager


class RecordingProxy:
    def __init__(self):
        self.seeds: list[int | None] = []

    async def generate(self, req, tag, *, trace=None, cost=None):
        self.seeds.append(req.sampling.seed)
        return SimpleNamespace(
            output_token_ids=[3, 4],
            output_logprobs=[-1.0, -1.0],
            token_versions=[0, 0],
            hardware="CPU",
            finish_reason="stop",
        )


def seeds_of(sampling_seed, env_seed, traj_id):
    proxy = RecordingProxy()
    manager = EnvManager(CountEnv(turns=2), proxy, CharCodec(), sampling=SamplingParams(seed=sampling_seed))
    traj = asyncio.run(manager.run(seed=env_seed, group_id="0:0", traj_id=traj_id))
    assert traj.status == "ok"
    return proxy.seeds


def test_each_request_gets_its_own_repeatable_seed():
    first = seeds_of(0, 11, "0:0:0:v0")
    assert len(first) == 2 and first[0] != first[1]  # two turns
    assert seeds_of(0, 11, "0:0:0:v0") == first  # the same trajectory again: the same seeds
    assert seeds_of(0, 11, "0:0:1:v0")[0] != first[0]  # another member of the group
    assert seeds_of(0, 12, "0:0:0:v0")[0] != first[0]  # another env seed (another run seed)
    assert seeds_of(1, 11, "0:0:0:v0")[0] != first[0]  # another sampling seed


def test_without_a_sampling_seed_requests_stay_unseeded():
    assert seeds_of(None, 11, "0:0:0:v0") == [None, None]
