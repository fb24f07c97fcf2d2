"""The ``rollart`` command: ``--version``, ``status``, ``run``, ``submit``/``jobs``/``logs``/``stop``, ``scale``, ``serve``,
``bench``, ``export``, ``plot``, ``trace``, ``view``, ``replay``, ``advise``.

One module of this package per command; this one only mounts them. Every command module imports only
the standard library when it loads (its work imports the rest when it runs), so ``rollart --version``
and ``rollart status`` stay fast; of the benches only the one named on the command line is imported.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import rollart
from rollart.cli.advise import add_advise_parser
from rollart.cli.bench import add_bench_parser
from rollart.cli.clock import STARTED  # noqa: F401 - the command's start, as early as it can be taken
from rollart.cli.export import add_export_parser
from rollart.cli.jobs import add_job_parsers
from rollart.cli.output import setup_console
from rollart.cli.plot import add_plot_parser
from rollart.cli.replay import add_replay_parser
from rollart.cli.run import add_run_parser
from rollart.cli.scale import add_scale_parser
from rollart.cli.serve import add_serve_parser
from rollart.cli.status import add_status_parser
from rollart.cli.trace import add_trace_parser
from rollart.cli.view import add_view_parser

DESCRIPTION = (
    "rollart: reinforcement-learning post-training of LLM agents on heterogeneous, disaggregated clusters. "
    "Start with `rollart run quickstart`; `rollart COMMAND --help` describes each command."
)


class HelpFormatter(argparse.HelpFormatter):
    """Help with every option's default (``(default: X)``) where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        shown = (
            text
            and "default" not in text
            and default not in (None, False, [], argparse.SUPPRESS)
            and (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))
        )
        return f"{text} (default: %(default)s)" if shown else action.help


class Parser(argparse.ArgumentParser):
    """The parser of every rollart command and subcommand (sub-parsers are made of the same class)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``rollart`` parser; of the benches only the one named in ``argv`` is imported."""
    parser = Parser(prog="rollart", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"rollart {rollart.__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show everything: debug logging, Ray's and the workers' own output, their progress bars",
    )
    sub = parser.add_subparsers(dest="command")
    add_status_parser(sub)
    for add in (
        add_run_parser,
        add_serve_parser,
        add_export_parser,
        add_plot_parser,
        add_trace_parser,
        add_view_parser,
        add_replay_parser,
        add_job_parsers,
        add_scale_parser,
        add_advise_parser,
    ):
        add(sub)
    add_bench_parser(sub, list(sys.argv[1:] if argv is None else argv))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    setup_console(args.verbose)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


__all__ = ["DESCRIPTION", "HelpFormatter", "Parser", "build_parser", "main"]
