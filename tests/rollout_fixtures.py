"""Small envs, a character codec and an inference cluster on the simulated engine for runtime tests."""

from __future__ import annotations

import asyncio
import threading

import rollart as ra
from rollart.engines.simulated import SimulatedEngine
from rollart.rollout.inference_worker import inference_worker_class


class CharCodec:
    eos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [2 + (ord(c) % 60) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + (i % 26)) for i in ids if i != 0)


class CountEnv:
    """Two turns; reward 1 per step; tag and sizes like the built-in envs."""

    tag = "Count"
    max_steps = 4
    max_new_tokens = 4

    def __init__(self, turns: int = 2):
        self.turns, self.t = turns, 0

    def reset(self, seed=None):
        self.t = 0
        return f"start {seed}:", {"seed": seed}

    def step(self, action: str):
        self.t += 1
        return f" obs{self.t}:", 1.0, self.t >= self.turns, False, {}


class BrokenStepEnv(CountEnv):
    tag = "Broken"

    def step(self, action: str):
        raise RuntimeError("env server unreachable")


class FlakyResetEnv(CountEnv):
    """Fails its first ``failures`` resets, then works."""

    def __init__(self, failures: int):
        super().__init__()
        self.failures = failures

    def reset(self, seed=None):
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("reset timed out")
        return super().reset(seed)


class GatedEnv(CountEnv):
    """Blocks in step until the test opens its gate (a fail-slow env, under test control)."""

    tag = "Gated"

    def __init__(self, gate: threading.Event):
        super().__init__(turns=1)
        self.gate = gate

    async def step(self, action: str):
        while not self.gate.is_set():
            await asyncio.sleep(0.005)
        return " done", 1.0, True, False, {}


def simulated_cluster(rm, pool: str, mapping=None, **engine_options):
    cls = inference_worker_class(mapping or {"*": ["H20", "H800"]})
    options = {"decode_base_s": 0.001, "decode_per_seq_s": 0.0, "prefill_per_token_s": 0.0, "vocab_size": 50}
    options.update(engine_options)
    return ra.Cluster("infer", cls, rm, pool=pool, worker_kwargs={"engine": {"kind": "simulated", "options": options}})


class RefusingEngine(SimulatedEngine):
    """An engine (``{"kind": "rollout_fixtures:RefusingEngine", "model": "-"}``) refusing every request."""

    def __init__(self, model: str, **options):
        super().__init__(**options)

    def add_request(self, request):
        raise ValueError("prompt is longer than this engine's context")
