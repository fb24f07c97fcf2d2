"""The import layers of docs/architecture.md hold: import-linter checks the contracts of pyproject.toml
([tool.importlinter]: the layer order, no circles between the modules of one package, no library module
importing the public API facade) on the installed layout, where envs, pipelines and benchmarks are
subpackages of rollart; an upward import breaks them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the wheel's layout (pyproject's package-dir): these top-level folders install under rollart
MAPPED = {"envs": "envs", "pipelines": "pipelines", "benchmarks": "benchmarks"}


def _stage(dest: Path) -> Path:
    """A copy of the package as a wheel installs it (sources only), under ``dest``."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "rollart", dest / "rollart", ignore=skip)
    for folder, name in MAPPED.items():
        shutil.copytree(ROOT / folder, dest / "rollart" / name, ignore=skip)
    return dest


def _lint(staged: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the staged copy with the contracts of pyproject.toml, in a fresh interpreter
    whose ``rollart`` is the staged one."""
    code = "import sys\nfrom importlinter.cli import lint_imports\nsys.exit(lint_imports(sys.argv[1], no_cache=True, no_logo=True))"
    return subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "pyproject.toml")],
        cwd=staged,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(staged), "PYTHONSAFEPATH": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _stage(tmp_path_factory.mktemp("wheel-layout"))


def test_the_package_keeps_every_import_contract(staged: Path) -> None:
    probe = subprocess.run(
        [sys.executable, "-c", "import rollart.pipelines, rollart.benchmarks; print(rollart.pipelines.__file__)"],
        cwd=staged,
        env={"PYTHONPATH": str(staged), "PYTHONSAFEPATH": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip().startswith(str(staged)), probe.stdout  # the staged copy is what is checked
    done = _lint(staged)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("module", "upward", "contract"),
    [
        ("rollout/types.py", "import rollart.pipelines.agentic", "rollart imports one way"),
        ("cluster/dispatch.py", "from rollart.training import placement", "rollart imports one way"),
        ("training/data.py", "import rollart", "not the public API facade"),
        ("weights/snapshot.py", "from rollart.weights import ray_channel", "no import circles"),
    ],
)
def test_an_upward_import_or_a_circle_breaks_a_contract(
    tmp_path: Path, module: str, upward: str, contract: str
) -> None:
    staged = _stage(tmp_path)
    target = staged / "rollart" / module
    target.write_text(target.read_text() + f"\n{upward}  # added by the test\n")
    done = _lint(staged)
    assert done.returncode != 0, done.stdout
    broken = [line for line in done.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(contract in line for line in broken), done.stdout


LAYER_HEIGHTS = """
import json, sys, tomllib
import grimp
graph = grimp.build_graph("rollart", include_external_packages=False)
deps = {}
for module in graph.modules:
    parts = module.split(".")
    if len(parts) < 2:
        continue
    for dep in graph.find_modules_directly_imported_by(module):
        if dep.count(".") >= 1 and dep.split(".")[1] != parts[1]:
            deps.setdefault(parts[1], set()).add(dep.split(".")[1])
print(json.dumps({k: sorted(v) for k, v in deps.items()}))
"""


def test_every_package_sits_one_layer_above_the_highest_it_imports(staged: Path) -> None:
    """The layer order is the real one: a package's layer is one above the highest layer of the packages
    it imports (so no layer is above another for no reason, and every boundary has an import across it)."""
    import json
    import tomllib

    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    height = {pkg.strip(): len(layers) - 1 - i for i, line in enumerate(layers) for pkg in line.split("|")}
    done = subprocess.run(
        [sys.executable, "-c", LAYER_HEIGHTS],
        cwd=staged,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(staged), "PYTHONSAFEPATH": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    deps = json.loads(done.stdout)
    wrong = {
        pkg: (height[pkg], 1 + max((height[d] for d in deps.get(pkg, [])), default=-1))
        for pkg in height
        if height[pkg] != 1 + max((height[d] for d in deps.get(pkg, [])), default=-1)
    }
    assert wrong == {}, f"package: (its layer from the bottom, the layer its imports put it at): {wrong}"
