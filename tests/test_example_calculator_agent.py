"""The calculator agent of ``examples/calculator_agent`` (written only against the ``openai`` SDK) trained
through the policy endpoint on a CPU: its reward rises, every trained episode is the session's own
tokens, and the ledger holds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "calculator_agent"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_calculator_agents_reward_rises(tmp_path):
    sys.path.insert(0, str(EXAMPLE))
    try:
        import run
    finally:
        sys.path.remove(str(EXAMPLE))
    history = run.main(["--out", str(tmp_path), "--steps", "16"])
    rewards = [h["reward_mean"] for h in history]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= first + 0.15, rewards
    assert all(h["ledger"]["rewards_invented"] == 0 for h in history)
    ledger = json.loads((tmp_path / "calculator" / "ledger.json").read_text())
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0
    assert ledger["trained"] == 16 * 8 * 8
