"""Placement on a two-node Ray cluster on one machine (Ray's own multi-node test utility)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "two_node_placement.py"


@pytest.mark.timeout(300)
def test_each_worker_sits_on_the_node_with_its_hardware(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "meta.sqlite")],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    nodes = out["nodes"]
    assert set(nodes) == {"H800", "H20"} and nodes["H800"] != nodes["H20"]
    assert out["node_addresses"] == ["127.0.0.1"]
    assert [w["hardware"] for w in out["workers"]] == ["H800", "H800", "H20", "H20"]
    for w in out["workers"]:
        assert w["node_id"] == nodes[w["hardware"]], w
    assert out["routed"]["FrozenLake"] == {"hardware": "H800", "node_id": nodes["H800"]}
    assert out["routed"]["Sokoban"] == {"hardware": "H20", "node_id": nodes["H20"]}
