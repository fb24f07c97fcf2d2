"""``rollart run CONFIG [--resume] [--set key=value ...]``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

log = logging.getLogger(__name__)


def list_configs() -> str:
    """The shipped configs, one per line: name, path, and the first comment line of the file."""
    from rollart.config import shipped_configs

    lines = []
    for name, path in sorted(shipped_configs().items()):
        first = next((x for x in path.read_text().splitlines() if x.startswith("#")), "").lstrip("# ").strip()
        lines.append(f"{name}\t{path}\t{first}".rstrip())
    return "\n".join(lines)


def build_pipeline(cfg: Any, **kwargs: Any) -> Any:
    """The config's pipeline (``pipeline:``, checked when the config loaded), else ``AgenticPipeline``."""
    pipeline_cls = cfg.pipeline_class()
    if pipeline_cls is None:
        from rollart.pipelines.agentic import AgenticPipeline

        pipeline_cls = AgenticPipeline
    return pipeline_cls(cfg, **kwargs)


def cmd_run(args: argparse.Namespace) -> int:
    if args.list:
        sys.stdout.write(list_configs() + "\n")
        return 0
    if args.config is None:
        log.error("rollart run: give a CONFIG (a YAML path or a shipped name; --list shows them)")
        return 2
    from rollart.config import ConfigError, load_config, parse_sets

    try:  # every check, plug-ins included, before anything starts
        cfg = load_config(args.config, parse_sets(args.set))
    except ConfigError as err:
        log.error("%s", err)
        return 2
    pipe = build_pipeline(cfg, resume=args.resume)
    try:
        history = pipe.run()
    except BaseException as err:  # the store's record of this attempt keeps the cause
        rm = getattr(pipe, "rm", None)
        if rm is not None:
            rm.store.end_run(rm.job_id, "failed", repr(err))
        raise
    finally:
        pipe.shutdown()
    records = pipe.step_records() if hasattr(pipe, "step_records") else history  # every step, not just the kept
    last = records[-1] if records else {}
    metrics, plot = getattr(pipe, "metrics_path", None), getattr(pipe, "plot_path", None)
    summary = {
        "steps": len(records),
        "final_reward": last.get("reward_mean"),
        "first_reward": records[0].get("reward_mean") if records else None,
        "metrics": str(metrics) if metrics else None,
        "plot": str(plot) if plot else None,
        "hf": str(getattr(pipe, "export_path", None) or "") or None,
    }
    log.info("done: %s", json.dumps(summary))
    if args.json:
        sys.stdout.write(json.dumps(summary) + "\n")
    return 0


def add_run_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="run a pipeline from a YAML config")
    p.add_argument("config", nargs="?", help="pipeline YAML, e.g. pipelines/quickstart.yaml, or a shipped name")
    p.add_argument("--list", action="store_true", help="list the shipped configs (usable by name) and exit")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    p.set_defaults(func=cmd_run)
