"""A non-editable install from a built wheel, used from outside the checkout: ``rollart run --list``
shows the shipped configs and ``rollart run quickstart`` trains a few steps.

The wheel is built from a copy of the checkout (tracked and untracked, non-ignored files) and
installed with ``--no-deps`` into a fresh virtual environment that sees this environment's
dependencies through a ``.pth`` file (no downloads).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _checkout_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    )
    return [f for f in out.stdout.splitlines() if (REPO / f).is_file()]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout (the copy takes the files git knows of)")
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    for rel in _checkout_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(root / "wheels"), str(src)],
        env=env,
        check=True,
        capture_output=True,
    )
    (wheel,) = (root / "wheels").glob("rollart-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=env, check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # this environment's packages (torch, ray, ...) after the new venv's own: the wheel's rollart wins
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "shared_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    subprocess.run(
        [*pip, "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        env=env,
        check=True,
        capture_output=True,
    )
    outside = root / "elsewhere"
    outside.mkdir()
    return venv, outside, env


def test_the_installed_package_is_the_wheel_and_lists_the_shipped_configs(installed):
    venv, outside, env = installed
    where = subprocess.run(
        [
            str(venv / "bin/python"),
            "-c",
            "import rollart, rollart.pipelines; print(rollart.__file__, rollart.pipelines.__file__)",
        ],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(str(venv) in w and "site-packages" in w for w in where), where
    out = subprocess.run(
        [str(venv / "bin/rollart"), "run", "--list"], cwd=outside, env=env, capture_output=True, text=True, check=True
    )
    names = {line.split("\t")[0] for line in out.stdout.splitlines()}
    assert {"quickstart", "agentic_async"} <= names
    assert all(str(venv) in line.split("\t")[1] for line in out.stdout.splitlines())


def test_rollart_run_quickstart_trains_from_outside_the_checkout(installed):
    venv, outside, env = installed
    proc = subprocess.run(
        [
            str(venv / "bin/rollart"),
            "run",
            "quickstart",
            "--set",
            "steps=2",
            "--set",
            "checkpoint_every=2",
            "--set",
            f"cluster.metadata_store={outside / 'meta.sqlite'}",
            "--json",
        ],
        cwd=outside,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=1100,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and 0.0 <= summary["final_reward"] <= 1.0
    run = outside / "runs" / "quickstart"  # relative output_dir: under the working directory
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert (run / "checkpoint" / "step-00000002" / "model.safetensors").exists()
    assert (run / "hf" / "config.json").exists() and summary["hf"] == str(run.resolve() / "hf")
