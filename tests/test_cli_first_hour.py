"""What a new user meets on the command line: complete help texts with defaults, usage for a `rollart run`
without a config, a readable `rollart status`, a run folder that is never mixed with another run, and a
Ctrl-C that stops cleanly with one line naming the last checkpoint and the command that continues."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rollart.benchmarks import BENCHES
from rollart.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]


def parsers(parser: argparse.ArgumentParser, path: str = "rollart"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def test_help_texts_are_complete_with_defaults_and_cite_no_paper_sections(capsys):
    top = build_parser(["--help"])
    assert top.description and top.description.rstrip().endswith(".") and "rollart run quickstart" in top.description
    seen = 0
    for path, parser in parsers(build_parser(["serve", "--help"])):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{path} {action.option_strings or action.dest}: no help"
            seen += 1
        text = parser.format_help()
        assert not re.search(r"seed 00\d|§", text), f"{path} --help cites a paper section"
    assert seen > 40
    # defaults are shown (argparse's %(default)s, expanded in the formatted help)
    serve = dict(parsers(build_parser(["serve"])))["rollart serve rewards"].format_help()
    assert re.search(r"--port PORT\s+TCP port to listen on \(default: 8100\)", serve)
    assert re.search(
        r"--max-body-bytes MAX_BODY_BYTES\s+largest request body \(413 past it\) \(default: 4194304\)", serve
    )
    # every bench has a one-line summary in `rollart bench --help`: a whole phrase, no paper citation
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for name in BENCHES:
        assert re.search(rf"^\s+{re.escape(name)}\s+\S", out, re.M), f"bench {name} has no summary"
    assert not re.search(r"seed 00\d|§", out)


def test_rollart_run_without_a_config_prints_the_usage(capsys):
    assert main(["run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: rollart run ") and "rollart run --list" in err


def test_status_shows_words_and_dates_not_none_and_epoch_seconds(tmp_path, capsys):
    from rollart.resource_manager.store import MetadataStore

    store = MetadataStore(tmp_path / "meta.sqlite")
    store.record_job("job-1", "127.0.0.1:6379")
    store.start_run("job-1")
    store.end_job("job-1")
    assert main(["status", "--store", str(tmp_path / "meta.sqlite")]) == 0
    out = capsys.readouterr().out
    assert "None" not in out
    assert not re.search(r"\b1[0-9]{9}\.[0-9]+\b", out)  # no raw epoch times
    assert re.search(r"\d{4}-\d\d-\d\d", out) and "ended" in out and "job-1" in out


CONFIG = {
    "name": "ctrlc",
    "cluster": {"local_resources": {"CPU": 4}},
    "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
    "envs": [{"name": "reverse", "groups": 4, "kwargs": {"length": 2}}],
    "rollout": {"num_env_groups": 4, "group_size": 4, "batch_groups": 4, "alpha": 0},
    "sampling": {"temperature": 1.0, "max_new_tokens": 2, "seed": 0},
    "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
    "steps": 100000,
    "checkpoint_every": 1,
    "checkpoint_keep": 2,
    "export": {"hf": False},
    "output_dir": "runs/ctrlc",
}


def rollart(tmp_path: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollart.cli", *args], cwd=tmp_path, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(1200)
def test_ctrl_c_resume_and_a_second_run_never_mix(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(CONFIG))
    run = tmp_path / "runs" / "ctrlc"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollart.cli", "run", "c.yaml", "--set", "train.lr=0.002"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 600
    while not (run / "checkpoint" / "latest").exists():  # polling the run's files for its first checkpoint
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "CancelledError" not in err, err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("rollart run: stopped")]
    found = re.fullmatch(r"rollart run: stopped in step (\d+); last checkpoint (\S+); continue with: (.+)", line)
    assert found, line
    ckpt = Path(found.group(2))
    assert ckpt.parent == (run / "checkpoint").resolve() and ckpt.name.startswith("step-") and ckpt.is_dir()
    command = shlex.split(found.group(3))
    assert command == ["rollart", "run", "c.yaml", "--set", "train.lr=0.002", "--resume"]
    assert (run / "ledger.json").is_file()  # the stopped run's account of its trajectories

    # a second run into the same folder without a flag is refused, naming both ways on
    again = rollart(tmp_path, "run", "c.yaml", "--set", "steps=1")
    assert again.returncode == 2
    assert "holds an earlier run" in again.stderr and "--resume" in again.stderr and "--overwrite" in again.stderr

    # the printed command continues the run (here to two steps past its checkpoint) and accounts for
    # every trajectory: the rounds started before the stop are played again, none is lost
    done = int(ckpt.name.removeprefix("step-"))
    resumed = rollart(tmp_path, *command[1:], "--set", f"steps={done + 2}", "--json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    [summary] = [json.loads(x) for x in resumed.stdout.splitlines() if x.startswith("{")]  # the summary, once
    assert summary["steps"] == done + 2 and summary["output_dir"] == str(run.resolve())
    ledger = json.loads((run / "ledger.json").read_text())
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0, ledger

    # --overwrite replaces the earlier run: no checkpoint or metrics of it are left to mix with the new one
    fresh = rollart(tmp_path, "run", "c.yaml", "--overwrite", "--set", "steps=1")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoint").glob("step-*")) == ["step-00000001"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1


def test_resume_of_an_empty_folder_and_both_flags_are_refused(tmp_path, caplog):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**CONFIG, "output_dir": str(tmp_path / "none")}))
    assert main(["run", str(tmp_path / "c.yaml"), "--resume"]) == 2
    assert "holds no run to continue" in caplog.text
    assert main(["run", str(tmp_path / "c.yaml"), "--resume", "--overwrite"]) == 2
    assert "exclude each other" in caplog.text
    assert not (tmp_path / "none").exists()  # refused before anything was written


def test_a_submitted_jobs_relative_output_dir_goes_to_the_jobs_folder(tmp_path, monkeypatch):
    from rollart.cli.jobs import job_output_dir

    monkeypatch.delenv("ROLLART_JOBS_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    env = {"ROLLART_SUBMITTED_JOB": "alice-1"}
    assert job_output_dir(Path("runs/q"), env) == tmp_path / "rollart-jobs" / "alice-1" / "runs" / "q"
    assert job_output_dir(Path("/data/q"), env) is None  # an absolute folder is kept
    assert job_output_dir(Path("runs/q"), {}) is None  # not a submitted job
    monkeypatch.setenv("ROLLART_JOBS_DIR", str(tmp_path / "shared"))
    assert job_output_dir(Path("runs/q"), env) == tmp_path / "shared" / "alice-1" / "runs" / "q"
    assert os.environ["HOME"] == str(tmp_path)
