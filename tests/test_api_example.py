"""The API example of the README (examples/api_tour.py) runs as written against a reward server on 127.0.0.1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from http_fixtures import ScriptedServer

EXAMPLE = Path(__file__).parent.parent / "examples" / "api_tour.py"


def exact(body):
    return {"result": [float(t["response"] == t["ground_truth"]) for t in body["trajectories"]]}


@pytest.mark.timeout(300)
def test_api_tour_runs_with_a_local_reward_service():
    with ScriptedServer() as srv:
        srv.default = (200, exact, {})
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.run(
            [sys.executable, str(EXAMPLE), srv.url("/rewards/math")],
            capture_output=True,
            text=True,
            timeout=280,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["metrics"] == {"rank": [0, 1], "rows": [3, 2], "loss": [1.0, 3.5]}
        assert (out["frozenlake_on"], out["sokoban_on"]) == ("H800", "H20")
        assert out["scores"] == [1.0, 0.0]
        assert [r["path"] for r in srv.requests] == ["/rewards/math"]


@pytest.mark.timeout(300)
def test_the_concepts_example_is_the_tour_and_runs_as_written(tmp_path):
    """docs/concepts.md shows examples/api_tour.py whole; the block runs as a reader would run it: saved
    to a file, no argument (it starts its own reward server)."""
    import re

    page = (Path(__file__).parent.parent / "docs" / "concepts.md").read_text()
    block = re.search(r"## An example\n.*?```python\n(.*?)```", page, flags=re.S).group(1)
    assert block == EXAMPLE.read_text()
    (tmp_path / "tour.py").write_text(block)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "tour.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["frozenlake_on"], out["sokoban_on"], out["scores"]) == ("H800", "H20", [1.0, 0.0])
