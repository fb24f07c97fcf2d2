"""Quiet by default: Ray's notices and the workers' chatter (empty lines, progress bars) go to the run's
log file, not the console; one progress display, a line per tenth of the run when not on a terminal;
`-v` shows everything."""

from __future__ import annotations

import io
import logging
import os

import pytest

from rollart.cli.output import (
    RUN_LOG,
    WORKER_LOGGER,
    ConsoleHandler,
    QuietConsole,
    QuietRay,
    WorkerOutput,
    log_run_to,
    setup_console,
    stop_logging_to,
)
from rollart.pipeline.progress import LEGEND, StepProgress
from rollart.resource_manager import launcher

WORKER_BATCH = {
    "pid": 7700,
    "actor_name": "TorchTrainWorker",
    "is_err": True,
    "lines": [
        "",
        "Loading weights:   0%|          | 0/26 [00:00<?, ?it/s]Loading weights: 100%|██████████| 26/26 [00:00<00:00, 1859.65it/s]",
        "Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 274.44it/s]",
        "   ",
        "WARNING rollart.training: gradient norm is nan at step 3",
    ],
}


def record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_the_console_shows_rollarts_lines_and_everyones_warnings_but_not_rays_token_notice():
    quiet, ray = QuietConsole(), QuietRay()
    assert quiet.filter(record("rollart.cli.run", logging.INFO, "output folder: runs/q"))
    assert not quiet.filter(record("matplotlib.font_manager", logging.INFO, "generated new fontManager"))
    assert quiet.filter(record("httpx", logging.WARNING, "retrying"))
    token = "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out."
    assert not ray.filter(record("ray._private.authentication", logging.WARNING, token))
    assert not ray.filter(record("ray._private.worker", logging.INFO, "Started a local Ray instance."))
    assert ray.filter(record("ray._private.worker", logging.WARNING, "the object store is full"))


def test_worker_chatter_goes_to_the_log_file_and_the_rest_to_the_console(tmp_path, monkeypatch):
    handler = log_run_to(tmp_path, verbose=False)
    try:
        console = io.StringIO()
        WorkerOutput(stream=console)(WORKER_BATCH)
        WorkerOutput(stream=console)({"pid": "autoscaler", "lines": ["======== Autoscaler status ========"]})
    finally:
        stop_logging_to(handler)
    assert (
        console.getvalue() == "(TorchTrainWorker pid=7700) WARNING rollart.training: gradient norm is nan at step 3\n"
    )
    logged = (tmp_path / RUN_LOG).read_text()
    assert logged.count(f"INFO {WORKER_LOGGER}: (TorchTrainWorker pid=7700)") == 5  # every line, in the file
    assert "Loading weights: 100%" in logged and "Autoscaler" not in logged
    assert launcher._worker_output is None  # the run ended: Ray's own printer again for the next one


def test_verbose_keeps_ray_s_printer_and_every_line(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    handler = log_run_to(tmp_path, verbose=True)
    try:
        assert launcher._worker_output is None  # Ray prints the workers' lines itself, progress bars too
        assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
    finally:
        stop_logging_to(handler)
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        setup_console(verbose=True)
        [console] = [h for h in root.handlers if isinstance(h, ConsoleHandler)]
        assert not console.filters and root.level == logging.DEBUG
        assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ  # transformers' bars show
        setup_console(verbose=False)  # called again: one console handler, now quiet
        [console] = [h for h in root.handlers if isinstance(h, ConsoleHandler)]
        assert any(isinstance(f, QuietConsole) for f in console.filters)
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"  # rollart export, serve policy: no bars
    finally:
        root.handlers[:] = before


def test_progress_off_a_terminal_is_a_line_per_tenth_of_the_run_with_its_legend(caplog):
    caplog.set_level(logging.INFO)
    out = io.StringIO()
    progress = StepProgress("quickstart", 600, 0, stream=out, interactive=False)
    for step in range(600):
        progress.update({"reward_mean": step / 600, "version": step + 1})
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[0].startswith("quickstart: step 60/600 (10%), reward 0.098, v 60; ")
    assert lines[-1].startswith("quickstart: step 600/600 (100%), reward 0.998, v 600; ") and lines[-1].endswith("done")
    assert [r.getMessage() for r in caplog.records] == [f"quickstart: steps 1 to 600; {LEGEND}"]
    assert "v = the policy version" in LEGEND


@pytest.mark.parametrize("initial", [0, 595])
def test_a_resumed_run_counts_its_remaining_steps(initial):
    out = io.StringIO()
    progress = StepProgress("q", 600, initial, stream=out, interactive=False)
    for _ in range(initial, 600):
        progress.update({"reward_mean": 1.0, "version": 1})
    assert out.getvalue().splitlines()[-1].startswith("q: step 600/600 (100%)")
    assert len(out.getvalue().splitlines()) <= 10


def test_the_token_notice_of_a_local_ray_is_a_debug_line(caplog):
    """Every command that starts a local Ray (run, serve policy, the API): Ray's notice that it enabled
    token authentication is rollart's DEBUG line (-v), not a warning on the console."""
    ray_logger = logging.getLogger("ray._private.authentication.authentication_token_setup")

    class Console(logging.Handler):  # stands for Ray's console handler
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    console = Console()
    logging.getLogger("ray").addHandler(console)
    caplog.set_level(logging.DEBUG, logger=launcher.__name__)
    notice = "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out."
    try:
        with launcher._token_notice_at_debug():
            ray_logger.warning(notice)
            ray_logger.warning("the object store is full")
        ray_logger.warning(notice)  # outside a local start: as Ray logs it
    finally:
        logging.getLogger("ray").removeHandler(console)
    assert console.lines == ["the object store is full", notice]
    assert [r.getMessage() for r in caplog.records if r.name == launcher.__name__] == [f"ray: {notice}"]
