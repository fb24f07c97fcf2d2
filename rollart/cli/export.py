"""``rollart export RUN_DIR --hf OUT [--base-model PATH]``: the latest checkpoint of a run as a Hugging
Face folder."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

log = logging.getLogger(__name__)


def cmd_export(args: argparse.Namespace) -> int:
    from rollart.training.export import export_run

    try:
        out = export_run(args.run_dir, args.hf, base_model=args.base_model)
    except (FileNotFoundError, ValueError, KeyError) as err:
        log.error("rollart export: %s", err)
        return 2
    sys.stdout.write(json.dumps({"hf": str(out)}) + "\n")
    return 0


def add_export_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="export a run's latest checkpoint as a Hugging Face model folder")
    p.add_argument("run_dir", help="the run's output folder (output_dir of its config, e.g. runs/quickstart)")
    p.add_argument("--hf", required=True, metavar="OUT", help="folder to write (config.json, model.safetensors, ...)")
    p.add_argument(
        "--base-model",
        default=None,
        help="the Hugging Face folder the run started from (recorded in the checkpoint; needed for old ones)",
    )
    p.set_defaults(func=cmd_export)
