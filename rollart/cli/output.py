"""What the ``rollart`` command prints, and what goes to the run's log file instead.

The console shows rollart's own lines (INFO and up) and every other library's warnings and errors;
``-v`` shows everything at DEBUG. A ``rollart run`` also writes ``RUN_DIR/rollart.log``: every line at
INFO and up, rollart's, Ray's and every worker's, whatever reached the console. Quiet by default:

- Ray's own INFO lines, and its notice that a local Ray enabled token authentication, go to the log
  file only; Ray's other warnings and errors stay on the console;
- the workers' output (the lines Ray forwards to the driver) is printed by :class:`WorkerOutput`: every
  line into the log file, and on the console all but empty lines and progress bars (the model loading
  and writing bars of ``transformers``, which are switched off besides: ``HF_HUB_DISABLE_PROGRESS_BARS``);
  Ray's deduplication of repeated worker lines, and its notice, are not used;
- console lines are written with ``tqdm.write``, above the run's progress bar instead of through it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

RUN_LOG = "rollart.log"
"""The run's log file, in its output folder."""
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
WORKER_LOGGER = "rollart.workers"
"""The logger of the workers' forwarded lines (the log file's; the console gets them from WorkerOutput)."""
PROGRESS_LINE = re.compile(r"\d+%\|.*\||\|[\s█▏▎▍▌▋▊▉]*\|\s*\d+/\d+|\d+/\d+ \[[\d:<?]+")
"""A tqdm progress bar (``Loading weights:  50%|█████     | 13/26 [00:00<00:00, ...]``)."""
RAY_NOTICES = ("Token authentication is enabled for this Ray cluster",)
"""Ray warnings that say nothing a rollart user must act on: the log file only."""


class ConsoleHandler(logging.Handler):
    """Writes each record to ``sys.stderr`` (the one of the moment) with ``tqdm.write``: above a progress
    bar when one is showing."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # as logging's handlers do: never raise from a log call
            self.handleError(record)


class QuietConsole(logging.Filter):
    """rollart's lines at INFO and up (and a script's own, ``__main__``); the rest at WARNING and up."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        return record.levelno >= logging.INFO and record.name.split(".")[0] in ("rollart", "__main__")


class QuietRay(logging.Filter):
    """Ray's driver-side lines on the console: warnings and errors, except :data:`RAY_NOTICES`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        return not str(record.getMessage()).startswith(RAY_NOTICES)


QUIET_RAY = QuietRay()


def setup_console(verbose: bool) -> None:
    """The command's console logging: DEBUG and everything with ``verbose``, else quiet (module doc)."""
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for old in [h for h in root.handlers if isinstance(h, ConsoleHandler)]:  # main() called again
        root.removeHandler(old)
    handler = ConsoleHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    if not verbose:
        handler.addFilter(QuietConsole())
        # the model loading and writing bars of transformers (rollart export, serve policy; the workers of
        # a local Ray inherit it), read when transformers is imported
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    root.addHandler(handler)


def log_run_to(run_dir: Path, verbose: bool) -> logging.Handler:
    """Write every line at INFO and up (DEBUG with ``verbose``) into ``run_dir/rollart.log`` (appended to:
    a resumed run adds to it), and, unless ``verbose``, keep Ray's chatter and the workers' progress bars
    off the console (module doc). Call before Ray starts; returns the file's handler."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / RUN_LOG, encoding="utf-8")
    handler.setLevel(logging.DEBUG if verbose else logging.INFO)
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.getLogger().addHandler(handler)
    workers = logging.getLogger(WORKER_LOGGER)
    workers.propagate = False  # the console gets them from WorkerOutput, filtered
    workers.setLevel(logging.INFO)
    workers.addHandler(handler)
    ray_logger = logging.getLogger("ray")  # Ray's own handler does not propagate: give it the file too
    ray_logger.addHandler(_Forward(handler))  # (ray.init sets the formatter of every handler it finds)
    if verbose:
        return handler
    root_handlers = logging.getLogger().handlers
    for h in ray_logger.handlers:  # Ray's own (a test runner may have put its handlers there too)
        if not isinstance(h, _Forward) and h not in root_handlers:
            h.addFilter(QUIET_RAY)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # here and in the local Ray's workers (a program's run)
    from rollart.resource_manager.launcher import set_worker_output

    set_worker_output(WorkerOutput())
    return handler


class _Forward(logging.Handler):
    """Passes records on to ``target`` (in its format)."""

    def __init__(self, target: logging.Handler):
        super().__init__(target.level)
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        self.target.handle(record)


def stop_logging_to(handler: logging.Handler) -> None:
    """Undo :func:`log_run_to` (the run ended; a program may run another)."""
    for name in ("", WORKER_LOGGER):
        logging.getLogger(name).removeHandler(handler)
    ray_logger = logging.getLogger("ray")
    for forward in [h for h in ray_logger.handlers if isinstance(h, _Forward) and h.target is handler]:
        ray_logger.removeHandler(forward)
    for h in ray_logger.handlers:
        h.removeFilter(QUIET_RAY)
    handler.close()
    from rollart.resource_manager.launcher import set_worker_output

    set_worker_output(None)


class WorkerOutput:
    """Prints the lines Ray forwards from the workers (a handler of Ray's worker-output dispatcher, in
    place of its printer): each into the log file, and on the console (stderr) all but empty lines and
    progress bars, each with its worker (``(TorchTrainWorker pid=7700) ...``)."""

    def __init__(self, stream: Any = None):
        self.stream = stream
        self.log = logging.getLogger(WORKER_LOGGER)

    def __call__(self, data: dict[str, Any]) -> None:
        pid = data.get("pid")
        if pid == "autoscaler":  # the autoscaler's status reports (Ray prints its events only): not a worker's
            return
        who = data.get("actor_name") or data.get("task_name") or "worker"
        prefix = f"({who} pid={pid}) " if pid != "raylet" else "(raylet) "
        for raw in data.get("lines", []):
            line = str(raw).rstrip()
            self.log.info("%s%s", prefix, line)
            if not console_worthy(line):
                continue
            from tqdm import tqdm

            tqdm.write(prefix + line, file=self.stream or sys.stderr)


def console_worthy(line: str) -> bool:
    """Whether a worker's line belongs on the console: not empty, not a progress bar."""
    return bool(line.strip()) and PROGRESS_LINE.search(line) is None
