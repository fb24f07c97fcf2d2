"""``rollart submit`` with shell metacharacters in its arguments: Ray Jobs runs the entrypoint through a
shell, so every value must reach ``rollart run`` as typed and run nothing."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollart.cli import jobs as jobs_cli

HOSTILE = ["a$(touch {m}/dollar)", "a`touch {m}/backquote`", "a; touch {m}/semicolon", "a' \"; touch {m}/quotes #"]


class FakeJobs:
    """Ray's JobSubmissionClient, as far as ``rollart submit`` uses it."""

    def __init__(self) -> None:
        self.submitted: list[dict[str, Any]] = []

    def submit_job(self, **kw: Any) -> str:
        self.submitted.append(kw)
        return str(kw["submission_id"])


def submit(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, FakeJobs]:
    parser = argparse.ArgumentParser()
    jobs_cli.add_job_parsers(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["submit", *argv])
    fake = FakeJobs()
    monkeypatch.setattr(jobs_cli, "_client", lambda address: fake)
    return args.func(args), fake


def test_shell_metacharacters_in_submit_arguments_run_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    quickstart = Path(__file__).resolve().parents[1] / "pipelines" / "quickstart.yaml"
    config = tmp_path / "q$(touch config-ran).yaml"  # the config's own file name (the entrypoint runs here)
    shutil.copy(quickstart, config)
    sets = [f"name={h.format(m=marks)}" for h in HOSTILE]
    # a stand-in for the cluster's Python: writes the arguments it got (the entrypoint's argv)
    fake_python = tmp_path / "py"
    seen = tmp_path / "argv.json"
    fake_python.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(seen)!r}, 'w'))\n")
    fake_python.chmod(0o755)
    for value in sets:
        rc, jobs = submit([str(config), "--name", "job-1", "--set", value, "--python", str(fake_python)], monkeypatch)
        assert rc == 0 and len(jobs.submitted) == 1
        entrypoint = jobs.submitted[0]["entrypoint"]
        subprocess.run(["sh", "-c", entrypoint], cwd=tmp_path, check=True, timeout=60)  # as Ray Jobs runs it
        assert json.loads(seen.read_text()) == [
            "-m", "rollart.cli", "run", config.name, "--set", "cluster.job_id=job-1", "--set", value,
        ]  # fmt: skip
    assert sorted(p.name for p in marks.iterdir()) == [] and not (tmp_path / "config-ran").exists()  # nothing ran


def test_a_job_name_that_is_not_a_plain_id_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    quickstart = Path(__file__).resolve().parents[1] / "pipelines" / "quickstart.yaml"
    for name in ("$(id)", "a b", "job;rm", "-x"):
        rc, jobs = submit([str(quickstart), f"--name={name}"], monkeypatch)
        assert rc == 2 and jobs.submitted == [], name


def test_the_entrypoint_is_a_quoted_command_line() -> None:
    line = jobs_cli.submit_entrypoint("uv run python", "c d.yaml", "j", ["a=$(x)", "b='q'"])
    assert line.startswith("uv run python -m rollart.cli run ")
    import shlex

    assert shlex.split(line) == [
        "uv", "run", "python", "-m", "rollart.cli", "run", "c d.yaml", "--set", "cluster.job_id=j", "--set", "a=$(x)",
        "--set", "b='q'",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="--python"):
        jobs_cli.submit_entrypoint("'unclosed", "c.yaml", "j", [])
