"""The ``rollart`` command: ``--version``, ``status``, ``run``, ``submit``/``jobs``/``logs``/``stop``, ``serve``,
``bench``, ``export``, ``advise``.

One module of this package per command; this one only mounts them. Every command module imports only
the standard library when it loads (its work imports the rest when it runs), so ``rollart --version``
and ``rollart status`` stay fast; of the benches only the one named on the command line is imported.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import rollart
from rollart.cli.advise import add_advise_parser
from rollart.cli.bench import add_bench_parser
from rollart.cli.export import add_export_parser
from rollart.cli.jobs import add_job_parsers
from rollart.cli.run import add_run_parser
from rollart.cli.serve import add_serve_parser
from rollart.cli.status import add_status_parser


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``rollart`` parser; of the benches only the one named in ``argv`` is imported."""
    parser = argparse.ArgumentParser(prog="rollart", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"rollart {rollart.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command")
    add_status_parser(sub)
    for add in (add_run_parser, add_serve_parser, add_export_parser, add_job_parsers, add_advise_parser):
        add(sub)
    add_bench_parser(sub, list(sys.argv[1:] if argv is None else argv))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


__all__ = ["build_parser", "main"]
