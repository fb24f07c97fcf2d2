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


def test_the_help_of_serve_names_every_service(capsys):
    commands = dict(parsers(build_parser(["serve"])))
    services = [p.split()[-1] for p in commands if p.startswith("rollart serve ")]
    assert sorted(services) == ["env", "policy", "rewards"]
    top = build_parser(["--help"])
    [sub] = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    [entry] = [a.help for a in sub._choices_actions if a.dest == "serve"]  # its line in `rollart --help`
    assert all(f"({s})" in entry for s in services), entry
    with pytest.raises(SystemExit):
        main(["--help"])
    assert " ".join(entry.split()) in " ".join(capsys.readouterr().out.split())
    for service in services:
        assert f"rollart serve {service}" in commands["rollart serve"].description


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
    assert re.search(r"\d\d-\d\d \d\d:\d\d", out) and "ended" in out and "job-1" in out


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
    sets = ["--set", "train.lr=0.002", "--set", "checkpoint_every=1000"]  # no checkpoint before the Ctrl-C
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollart.cli", "run", "c.yaml", *sets],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 600
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):  # polling the run's files
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "CancelledError" not in err, err[-3000:]
    # the steps are cheap: the step in progress finished and was checkpointed, so nothing is redone
    assert re.search(r"Ctrl-C: finishing step \d+ \(about [\d.]+ s\) and writing a checkpoint", err), err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("rollart run: stopped")]
    found = re.fullmatch(r"rollart run: stopped after step (\d+); last checkpoint (\S+); continue with: (.+)", line)
    assert found, line
    ckpt = Path(found.group(2))
    assert ckpt.parent == (run / "checkpoint").resolve() and ckpt.is_dir()
    assert ckpt.name == f"step-{int(found.group(1)):08d}" == f"step-{len(metrics.read_text().splitlines()):08d}"
    command = shlex.split(found.group(3))
    assert command == ["rollart", "run", "c.yaml", *sets, "--resume"]
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
    # quiet: Ray's notices, empty worker lines and progress bars are in the run's log, not on the console
    assert "Token authentication" not in resumed.stderr and "deduplicates logs" not in resumed.stderr
    assert not re.search(r"pid=\d+\)\s*$", resumed.stderr, flags=re.M), resumed.stderr
    assert "Loading weights" not in resumed.stderr and "Writing model shards" not in resumed.stderr
    assert [x for x in resumed.stderr.splitlines() if x.startswith("ctrlc: step ")][-1].startswith(
        f"ctrlc: step {done + 2}/{done + 2} (100%)"
    )
    assert "Started a local Ray instance" in (run / "rollart.log").read_text()

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


def test_pools_that_do_not_fit_the_local_ray_are_refused_in_one_line_before_ray_starts(tmp_path):
    """The local Ray rollart starts declares cluster.local_resources (CPU: 4 here): known before it starts."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(CONFIG))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-m", "rollart.cli", "run", "c.yaml", "--set", "pools.train.cpus=16"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2
    [line] = proc.stderr.splitlines()  # one line: no traceback, no Ray start
    assert line.endswith(
        "ERROR rollart.cli.run: pools ['rollout', 'train'] ask for 17 CPUs but the local Ray rollart starts has 4 "
        f"(cluster.local_resources.CPU: 4; this machine: {os.cpu_count()}); lower pools.<name>.cpus or raise "
        "cluster.local_resources.CPU"
    )
    assert not (tmp_path / "runs").exists()


@pytest.fixture
def no_ray_start(monkeypatch):
    """A CPU machine where `rollart run` would start a local Ray; building the pipeline (starting Ray) fails."""
    from rollart.cli import run as run_cli
    from rollart.resource_manager import launcher, manager

    monkeypatch.setattr(manager, "starts_local_ray", lambda: True)
    monkeypatch.setattr(launcher, "detect_gpus", lambda: launcher.DetectedGpus())

    def started(cfg, **kwargs):
        raise AssertionError("the pipeline was built: Ray would have started")

    monkeypatch.setattr(run_cli, "build_pipeline", started)
    return run_cli


def test_hardware_the_local_ray_lacks_is_refused_before_ray_starts(tmp_path, caplog, no_ray_start):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**CONFIG, "output_dir": str(tmp_path / "run")}))
    assert main(["run", str(tmp_path / "c.yaml"), "--set", "pools.train={hardware: GPU, devices: 1}"]) == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line == (
        "pools.train.hardware: 'GPU' is not in the local Ray rollart starts (it declares CPU; GPUs detected: no "
        "GPU; cluster.local_resources: {CPU: 4}); fix the name, or add it to cluster.local_resources (logical "
        "devices: their workers run on the CPU)"
    )


def test_a_joined_cluster_is_checked_against_what_ray_reports_not_before(monkeypatch):
    from rollart.resource_manager.manager import check_local_pools

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # nothing listens: the check must not connect either
    assert check_local_pools({"train": {"hardware": "H800", "devices": 64}}, None) is None


def test_a_resource_error_after_ray_started_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    from rollart.cli import run as run_cli
    from rollart.resource_manager.specs import ResourceSpecError

    def refused(cfg, **kwargs):
        raise ResourceSpecError("pools.rollout could not be placed within 60s; free hardware or lower its devices")

    monkeypatch.setattr(run_cli, "check_local_pools", lambda *a: False, raising=False)
    monkeypatch.setattr(run_cli, "build_pipeline", refused)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # a joined cluster: checked once Ray reports it
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**CONFIG, "output_dir": str(tmp_path / "run")}))
    assert main(["run", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [x.split(": ", 1)[1] for x in err.splitlines() if " ERROR " in x] == [
        "pools.rollout could not be placed within 60s; free hardware or lower its devices"
    ]


def partial_run(folder: Path) -> None:
    """What a run leaves when it fails or stops before its first checkpoint."""
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "job_id").write_text("rollart-0123456789\n")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    (folder / "rollart.log").write_text("...\n")
    (folder / "ledger.json").write_text("{}\n")


class FakePipeline:
    """Stands for the pipeline: records what the folder held when the run began."""

    seen: list = []

    def __init__(self, cfg, resume=False, **kwargs):
        self.out_dir = cfg.out_dir
        FakePipeline.seen = sorted(p.name for p in cfg.out_dir.iterdir())

    def run(self):
        return []

    def shutdown(self):
        pass


def test_a_folder_whose_run_stopped_before_its_first_checkpoint_is_reused(tmp_path, caplog, no_ray_start):
    run = tmp_path / "run"
    partial_run(run)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**CONFIG, "output_dir": str(run)}))
    # --resume has nothing to continue: refused before Ray, saying the plain command reuses the folder
    assert main(["run", str(tmp_path / "c.yaml"), "--resume"]) == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line.startswith(f"--resume: {run} holds no checkpoint: its run stopped before the first one")
    assert line.endswith(
        f"start it again with `rollart run {tmp_path / 'c.yaml'}` (a folder without a checkpoint is reused)"
    )
    # the plain command starts over in it: nothing of the stopped run is left to mix with the new one
    no_ray_start.build_pipeline = FakePipeline
    assert main(["run", str(tmp_path / "c.yaml")]) == 0
    assert FakePipeline.seen == [".rollart.lock", "rollart.log"]  # the new run's own log only
    assert (run / "summary.json").is_file()  # a finished run: its folder is not reused without a flag
    assert main(["run", str(tmp_path / "c.yaml")]) == 2


def test_a_folder_with_other_files_or_a_running_run_is_not_reused(tmp_path, caplog, no_ray_start):
    run = tmp_path / "run"
    partial_run(run)
    (run / "notes.txt").write_text("mine\n")  # not written by rollart: never deleted without --overwrite
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**CONFIG, "output_dir": str(run)}))
    assert main(["run", str(tmp_path / "c.yaml"), "--resume"]) == 2
    assert "holds no checkpoint to continue from; start again with" in caplog.text and "--overwrite" in caplog.text
    assert main(["run", str(tmp_path / "c.yaml")]) == 2
    assert "holds an earlier run" in caplog.text and (run / "notes.txt").exists()
    # a run going on in the folder holds its lock: a second run, even with --overwrite, is refused
    (run / "notes.txt").unlink()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from rollart.cli.run_dir import hold; f = hold(__import__('pathlib').Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()",
            str(run),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        caplog.clear()
        assert main(["run", str(tmp_path / "c.yaml"), "--overwrite"]) == 2
        assert f"the output folder {run} is in use by a run that is still going (pid {holder.pid})" in caplog.text
        assert (run / "metrics.jsonl").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def assert_one_line_per_row(out: str, rows: dict[str, list[str]], width: int = 80) -> None:
    """Every line fits ``width``; each row (by its id) is one line holding all its ``rows[id]`` cells whole."""
    assert all(len(line) <= width for line in out.splitlines()), "\n" + out
    for key, cells in rows.items():
        lines = [line for line in out.splitlines() if line.startswith(key)]
        assert lines, f"{key} missing:\n{out}"
        for cell in cells:
            assert any(cell in line for line in lines), f"{key}: {cell!r} not on its line:\n{out}"


def test_status_at_80_columns_shows_each_job_on_one_line_with_its_name_and_folder(tmp_path, capsys, monkeypatch):
    from rollart.resource_manager.store import MetadataStore

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(tmp_path)
    store = MetadataStore("meta.sqlite")
    for job, name in (("rollart-0123456789", "quickstart"), ("rollart-abcdef0123", "calculator")):
        store.record_job(job, "127.0.0.1:6379")
        store.update_job(job, name=name, output_dir=str(tmp_path / "runs" / name))
        store.record_pool(job, "rollout", 0, "H20", 2, None, f"rollart/{job}/rollout/0", max_devices=8)
        store.record_binding(job, "actor_infer", 0, "rollout", "H20", "f" * 56, [], "actor-x", node_ip="127.0.0.1")
    store.end_run("rollart-0123456789", "failed", "ResourceSpecError('pools.rollout could not be placed ' " + "x" * 200)
    store.end_job("rollart-abcdef0123")
    assert main(["status", "--store", "meta.sqlite"]) == 0
    out = capsys.readouterr().out
    assert_one_line_per_row(
        out,
        {
            "rollart-0123456789": ["quickstart", "running", "runs/quickstart", "H20", "2/8", "failed", "actor_infer"],
            "rollart-abcdef0123": ["calculator", "ended", "runs/calculator", "finished"],
        },
    )
    # --wide: every column, each cell whole (wrapped when the terminal is narrower); --json: every field
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["status", "--store", "meta.sqlite", "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "x" * 200 in wide and "127.0.0.1:6379" in wide
    assert main(["status", "--store", "meta.sqlite", "--json"]) == 0
    jobs = json.loads(capsys.readouterr().out)["jobs"]
    assert {j["job_id"]: (j["name"], j["output_dir"]) for j in jobs}["rollart-0123456789"] == (
        "quickstart",
        str(tmp_path / "runs" / "quickstart"),
    )


def test_jobs_at_80_columns_shows_each_job_on_one_line(capsys, monkeypatch):
    from rollart.cli import jobs as jobs_cli

    rows = [
        {
            "job": "alice-run-1",
            "state": "running",
            "ray_status": "RUNNING",
            "priority": 10,
            "quota": {"H800": 2, "H20": 4},
            "asks": {"H800": 2, "H20": 4, "CPU": 8},
            "pools": {"rollout": {"devices": 3, "max_devices": 8, "joining": 1}},
            "submitted_at": 1764200000.0,
            "admitted_at": 1764200005.0,
            "ended_at": None,
            "output_dir": "/home/alice/rollart-jobs/alice-run-1/runs/quickstart",
            "driver_ip": "10.0.0.12",
            "message": "Job is currently running. " * 10,
        },
        {
            "job": "bob-2",
            "state": "queued",
            "ray_status": "PENDING",
            "priority": 0,
            "quota": {},
            "asks": {"H20": 2},
            "pools": None,
            "submitted_at": 1764200100.0,
            "admitted_at": None,
            "ended_at": None,
            "output_dir": None,
            "driver_ip": None,
            "message": "",
        },
    ]
    monkeypatch.setattr(jobs_cli, "list_jobs", lambda address: rows)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["jobs"]) == 0
    out = capsys.readouterr().out
    assert_one_line_per_row(
        out,
        {
            "alice-run-1": ["running", "10", "H800:2", "rollout 3/8", "10.0.0.12:"],  # long cells cut
            "bob-2": ["queued", "H20:2", "(not start"],
        },
    )
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["jobs", "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "10.0.0.12:/home/alice/rollart-jobs/alice-run-1/runs/quickstart" in wide
    assert "rollout 3/8 +1 joining" in wide and "Job is currently running. " * 3 in wide
