"""Only ``rollart`` is installed as a top-level name; the top-level folders install under it."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_installed_under_rollart():
    cfg = _setuptools()
    mapped = {name: ROOT / folder for name, folder in cfg["package-dir"].items()}
    found = set()
    for name, folder in mapped.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found == set(cfg["packages"]), "pyproject.toml [tool.setuptools] packages must list every package"
    assert all(p == "rollart" or p.startswith("rollart.") for p in cfg["packages"])


def test_no_generic_top_level_names_and_the_core_never_imports_upward(tmp_path):
    # run outside the checkout, so only what is installed can be imported
    code = (
        "import importlib.util as u, json\n"
        "print(json.dumps({n: u.find_spec(n) is not None for n in "
        "['envs', 'pipelines', 'benchmarks', 'rollart.envs', 'rollart.pipelines', 'rollart.benchmarks']}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # conftest puts the checkout there
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    )
    found = __import__("json").loads(out.stdout)
    assert found == {
        "envs": False,
        "pipelines": False,
        "benchmarks": False,
        "rollart.envs": True,
        "rollart.pipelines": True,
        "rollart.benchmarks": True,
    }
    core = [p for p in (ROOT / "rollart").rglob("*.py") if "testing" not in p.parts]
    upward = [
        f"{p.relative_to(ROOT)}"
        for p in core
        if any(
            re.search(rf"\brollart\.{top}\b", line)  # rollart.envs, not rollart.envservice
            for line in p.read_text().splitlines()
            if line.lstrip().startswith(("from ", "import "))
            for top in ("envs", "pipelines")
        )
    ]
    # the CLIs mount the pipeline (imported when `rollart run` / `rollart advise` runs); the config checks
    # env names and constructor kwargs against the env registry when it loads (inside its validators), and
    # its plug-in step reports what a plug-in registered there; the pipeline's env groups build the envs
    allowed = {
        "rollart/cli/run.py",
        "rollart/cli/advise.py",
        "rollart/config/pipeline.py",
        "rollart/config/sections.py",
        "rollart/config/plugin_step.py",
        "rollart/pipeline/env_groups.py",
    }
    # the env service serves envs (its errors are EnvErrors, RemoteEnv is a TextEnv): it sits on top of them
    allowed |= {u for u in upward if u.startswith("rollart/envservice/")}
    assert set(upward) <= allowed, upward


def test_shipped_configs_are_found_by_name(tmp_path, monkeypatch):
    from rollart.config import ConfigError, load_config, resolve_config_path

    monkeypatch.chdir(tmp_path)
    assert resolve_config_path("quickstart").name == "quickstart.yaml"
    assert load_config("pipelines/quickstart.yaml").name == "quickstart"
    try:
        load_config("no-such-config")
    except ConfigError as err:
        assert "quickstart" in str(err)
    else:
        raise AssertionError("a missing config loaded")


def test_torch_is_a_version_whose_weights_only_load_cannot_be_bypassed():
    from packaging.requirements import Requirement

    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    torch = next(r for r in deps if r.name == "torch")
    # torch.load(weights_only=True) before 2.6 can be made to run code (CVE-2025-32434); checkpoints load with it
    assert "2.5.1" not in torch.specifier and "2.6.0" in torch.specifier
    pinned = [
        ln.split("==")[1]
        for ln in (ROOT / "constraints" / "cpu.txt").read_text().splitlines()
        if ln.startswith("torch==")
    ]
    assert pinned and all(v in torch.specifier for v in pinned)  # the CPU constraints still install
