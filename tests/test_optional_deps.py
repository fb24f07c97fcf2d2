"""fastapi, uvicorn, prometheus-client, matplotlib and datasets are extras: the core runs without them,
the plot is skipped with a hint, and ``rollart serve rewards`` and reading a dataset say which extra
they need."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("fastapi", "uvicorn", "prometheus_client", "matplotlib", "datasets")


def test_pyproject_keeps_service_and_plot_libraries_out_of_the_core():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for name in ("fastapi", "uvicorn", "prometheus-client", "matplotlib", "requests", "datasets", "openai"):
        assert name not in core
    extras = project["optional-dependencies"]
    assert {"fastapi>=0.110", "uvicorn>=0.29", "prometheus-client>=0.20"} <= set(extras["serve"])
    assert any(d.startswith("matplotlib") for d in extras["plot"])
    assert any(d.startswith("datasets") for d in extras["data"])
    assert any(d.startswith("openai") for d in extras["agent"])
    # the test environment (dev) installs every extra the suite exercises
    in_dev = {x.strip() for d in extras["dev"] if d.startswith("rollart[") for x in d[8:-1].split(",")}
    assert {"serve", "ray-serve", "plot", "data", "agent", "docs"} <= in_dev


def test_the_core_runs_without_the_optional_libraries(tmp_path):
    """In a fresh interpreter where importing any of them fails."""
    code = f"""
import logging, sys
for name in {OPTIONAL!r}:
    sys.modules[name] = None  # import raises ImportError
logging.basicConfig(level=logging.INFO)
import rollart.pipelines.agentic as agentic, rollart.reward.client, rollart.cluster.serverless
from rollart.cli import main
from pathlib import Path
from rollart.pipeline.records import MetricsFile
assert agentic.AgenticPipeline and MetricsFile(Path({str(tmp_path)!r})).plot([{{"step": 0}}], "t") is None
assert main(["serve", "rewards", "rollart.envs.rewards:reverse"]) == 2
from rollart.data import DataError, load_rows
try:
    load_rows({str(ROOT / "README.md")!r}, field="data[0].train")
except DataError as err:
    assert "pip install 'rollart[data]'" in str(err), err
else:
    raise AssertionError("read a dataset without the datasets library")
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("OK")
    assert "metrics.png skipped" in out.stderr and "rollart[plot]" in out.stderr
    assert "rollart[serve]" in out.stderr
