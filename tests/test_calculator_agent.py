"""The calculator agent of ``examples/calculator_agent`` learns through the policy endpoint on a CPU.

``run.py`` builds the starting policy (the tiny model after a supervised warm-up on transcripts whose
operator is a coin flip, cached under ``$ROLLART_CACHE``), then trains ``agent.solve`` — a harness
written only against the ``openai`` SDK — as an ``agent`` env with a seeded sampler. What a user relies
on: the reward of the example rises (the agent learns which operation the words ask for), and the run
loses, invents and double-trains nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import mean

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "calculator_agent"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_calculator_agents_reward_rises(ray_local, tmp_path, monkeypatch):
    # the session's Ray (it runs first in its test process): a run that ends early leaves no Ray of its own
    monkeypatch.syspath_prepend(str(EXAMPLE))
    try:
        from run import main

        history = main(["--out", str(tmp_path)])
    finally:
        for name in ("run", "agent", "tasks", "warmup", "remote"):  # the example's modules, off this process
            sys.modules.pop(name, None)
        while str(EXAMPLE) in sys.path:  # run.py puts its folder first itself
            sys.path.remove(str(EXAMPLE))
    rewards = [h["reward_mean"] for h in history]
    assert len(rewards) >= 10
    first, last = mean(rewards[:5]), mean(rewards[-5:])
    assert last > first + 0.15, rewards
    ledger = json.loads((tmp_path / "calculator" / "ledger.json").read_text())
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0 and ledger["failed"] == 0, ledger
    assert all(h["trajectories_failed"] == 0 for h in history)
