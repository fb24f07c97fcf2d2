"""``rollart view RUN_DIR [--port N]``: a local web page of a run (127.0.0.1 only, offline): its curves,
the workers' timeline and a trajectory browser; it follows a run that is still going."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def writing(run_dir: Path) -> bool:
    """Whether a run on this machine holds ``run_dir`` now: the pid its lock file names is a live rollart
    process. The lock itself is not tried (a try, however short, could make a run starting at that moment
    find the folder in use)."""
    from rollart.cli.run_dir import LOCK

    try:
        text = (run_dir / LOCK).read_text().strip()
        cmdline = Path(f"/proc/{int(text)}/cmdline").read_bytes() if text.isdigit() else b""
    except (OSError, ValueError):
        return False
    return b"rollart" in cmdline


def cmd_view(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        log.error("rollart view needs the 'serve' extra (%s): pip install 'rollart[serve]'", err)
        return 2
    from rollart.tracking.viewer.server import serve

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        log.error("rollart view: %s is not a folder; give a run's output folder (e.g. runs/quickstart)", run_dir)
        return 2
    if not any((run_dir / name).is_file() for name in ("metrics.jsonl", "traces.jsonl")):
        log.warning(
            "rollart view: %s holds no metrics.jsonl or traces.jsonl yet; the page shows them once a run writes "
            "them (traces: {enabled: true} writes traces.jsonl)",
            run_dir,
        )
    if not 0 <= args.port <= 65535:
        log.error("rollart view: --port %d is not a port; give 0 (a free one) or 1-65535", args.port)
        return 2
    try:
        serve(run_dir, port=args.port, live=lambda: writing(run_dir))
    except OSError as err:
        log.error(
            "rollart view: cannot listen on 127.0.0.1:%d (%s); give another --port, or 0 for a free one", args.port, err
        )
        return 2
    except KeyboardInterrupt:
        pass
    return 0


def add_view_parser(sub: Any) -> None:
    p = sub.add_parser(
        "view", help="a local web page of a run: curves, the workers' timeline, a trajectory browser (live)"
    )
    p.add_argument("run_dir", help="the run's output folder (output_dir of its config, e.g. runs/quickstart)")
    p.add_argument("--port", type=int, default=0, help="the port on 127.0.0.1 (0: a free one; the URL is logged)")
    p.set_defaults(func=cmd_view)
