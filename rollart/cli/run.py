"""``rollart run CONFIG [--resume | --overwrite] [--set key=value ...]``."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path
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


def build_pipeline(cfg: Any, *, gpus: Any = None, **kwargs: Any) -> Any:
    """The config's pipeline (``pipeline:``, checked when the config loaded), else ``AgenticPipeline``.
    ``gpus``: the machine's GPUs, detected already (when the pools were checked)."""
    pipeline_cls = cfg.pipeline_class()
    if pipeline_cls is None:
        from rollart.pipeline.startup import start_ray_while_importing

        # Ray starts while torch, transformers and the pipeline import (the two take seconds each)
        start_ray_while_importing(
            cfg,
            bool(kwargs.get("resume")),
            "rollart.pipelines.agentic",
            "transformers.models.auto.tokenization_auto",
            gpus=gpus,
        )
        from rollart.pipelines.agentic import AgenticPipeline

        pipeline_cls = AgenticPipeline
    return pipeline_cls(cfg, **kwargs)


def submitted_output_dir(cfg: Any) -> Any:
    """A job of ``rollart submit`` runs in Ray's temporary copy of the config's folder, removed when the job
    ends: its relative ``output_dir`` goes under ``$ROLLART_JOBS_DIR/JOB`` (default ``~/rollart-jobs/JOB``)
    on the driver's host instead. Anything else: ``cfg`` unchanged."""
    from rollart.cli.jobs import job_output_dir

    placed = job_output_dir(cfg.out_dir)
    return cfg if placed is None else cfg.model_copy(update={"output_dir": str(placed)})


def _command(args: argparse.Namespace, *flags: str) -> str:
    """The command line of this run again (its config and ``--set`` items), with ``flags``."""
    return shlex.join(["rollart", "run", args.config, *[x for s in args.set for x in ("--set", s)], *flags])


def _resume_command(args: argparse.Namespace) -> str:
    return _command(args, "--resume")


def _interrupted(pipe: Any, args: argparse.Namespace) -> str:
    """The one line a stopped run prints: the step it stopped in, the last checkpoint, how to continue."""
    from rollart.training.checkpoint_io import latest_checkpoint

    step = getattr(pipe, "step_in_progress", None)  # 0-based; metrics.jsonl and checkpoints count from 1
    after = getattr(pipe, "stopped_after", None)  # a Ctrl-C let the step finish (and checkpointed it)
    where = (
        f" after step {after}" if isinstance(after, int) else f" in step {step + 1}" if isinstance(step, int) else ""
    )
    root = getattr(pipe, "checkpoint_root", None)
    ckpt = latest_checkpoint(root) if root is not None and Path(root).exists() else None
    if ckpt is None:
        return (
            f"rollart run: stopped{where}; no checkpoint was written yet (checkpoint_every), so nothing to "
            f"resume: start again with `{_command(args)}` (the folder is reused)"
        )
    return f"rollart run: stopped{where}; last checkpoint {ckpt}; continue with: {_resume_command(args)}"


def user_error(err: BaseException) -> bool:
    """Whether ``err`` is a mistake in the config or the command (one line, no traceback), not a fault."""
    from rollart.config import ConfigError
    from rollart.plugins import PluginError
    from rollart.resource_manager.specs import ResourceSpecError

    if isinstance(err, (ConfigError, PluginError, ResourceSpecError)):
        return True
    return isinstance(err, (FileNotFoundError, ValueError)) and str(err).startswith("--resume")


def _refuse(err: BaseException | str) -> int:
    """Log a refusal of the run as one line (``-v`` shows the traceback of an exception); exit status 2."""
    log.error("%s", err, exc_info=isinstance(err, BaseException) and log.isEnabledFor(logging.DEBUG))
    return 2


def _prepare_run_dir(args: argparse.Namespace, out_dir: Path) -> tuple[Any, logging.Handler]:
    """Hold the run's folder (its lock, kept open while the run runs), empty it when the run replaces
    another (``--overwrite``) or reuses a folder whose run stopped before its first checkpoint, and log
    into ``rollart.log`` there: the lock and the log file's handler."""
    from rollart.cli.output import log_run_to
    from rollart.cli.run_dir import LOCK, clear, hold, stale_partial_run

    stale = not args.resume and not args.overwrite and stale_partial_run(out_dir)
    lock = hold(out_dir)
    if args.overwrite and any(p.name != LOCK for p in out_dir.iterdir()):
        log.info("--overwrite: removing the earlier run in %s", out_dir)
        clear(out_dir)
    elif stale:
        log.info("%s holds a run that stopped before its first checkpoint (nothing to resume): reusing it", out_dir)
        clear(out_dir)
    return lock, log_run_to(out_dir, verbose=bool(getattr(args, "verbose", False)))


def cmd_run(args: argparse.Namespace) -> int:
    if args.list:
        sys.stdout.write(list_configs() + "\n")
        return 0
    if args.config is None:
        args.parser.print_usage(sys.stderr)
        sys.stderr.write(
            "rollart run: give a CONFIG: a YAML path or the name of a shipped config (rollart run --list shows "
            "them), e.g. rollart run quickstart\n"
        )
        return 2
    from rollart.cli.run_dir import run_dir_problem
    from rollart.config import ConfigError, load_config, parse_sets

    try:  # every check, plug-ins included, before anything starts
        cfg = submitted_output_dir(load_config(args.config, parse_sets(args.set)))
    except ConfigError as err:
        return _refuse(err)
    out_dir = cfg.out_dir
    problem = run_dir_problem(out_dir, resume=args.resume, overwrite=args.overwrite, command=_command(args))
    if problem is not None:
        return _refuse(problem)
    from rollart.resource_manager.manager import check_local_pools
    from rollart.resource_manager.specs import ResourceSpecError

    try:  # the pools against the local Ray about to start: known before it starts
        plan = check_local_pools(cfg.pools, cfg.cluster.local_resources)
    except ResourceSpecError as err:
        return _refuse(err)
    from rollart.cli.clock import STARTED
    from rollart.cli.output import stop_logging_to
    from rollart.pipeline.startup import set_command_started

    set_command_started(STARTED)  # the start-up line counts from the command's start, not the process's
    try:
        lock, run_log = _prepare_run_dir(args, out_dir)
    except OSError as err:  # another run took the folder meanwhile, or it cannot be written
        return _refuse(
            f"the output folder {out_dir} cannot be used: {err}; give this run its own folder "
            "(--set output_dir=runs/NEW)"
        )
    try:
        return _train(args, cfg, out_dir, gpus=plan.gpus if plan is not None else None)
    finally:
        stop_logging_to(run_log)
        set_command_started(None)  # a program that runs main() again, or builds a pipeline, starts anew
        if lock is not None:  # the folder is free for the next run
            lock.close()


def _train(args: argparse.Namespace, cfg: Any, out_dir: Path, gpus: Any = None) -> int:
    """Build the pipeline and run it; the summary at the end (the folder is checked and held)."""
    from rollart.cli.run_dir import SUMMARY

    try:
        pipe = build_pipeline(cfg, resume=args.resume, gpus=gpus)
    except KeyboardInterrupt:  # Ctrl-C, or `rollart stop`, while the workers were starting: nothing trained
        sys.stderr.write(
            "rollart run: stopped while starting, before the first step; nothing was trained: start again "
            f"with `{_command(args, *(['--resume'] if args.resume else []))}`\n"
        )
        return 130
    except Exception as err:
        if user_error(err):
            return _refuse(err)
        raise
    rm = getattr(pipe, "rm", None)
    if rm is not None:  # `rollart status`, `rollart jobs` and `rollart logs` show the run's name and folder
        rm.store.update_job(rm.job_id, name=cfg.name, output_dir=str(out_dir.resolve()))
    log.info("output folder: %s", out_dir.resolve())
    try:
        history = pipe.run()
    except KeyboardInterrupt:  # Ctrl-C, or `rollart stop` (SIGINT): the step in progress was cancelled
        if rm is not None:
            rm.store.end_run(rm.job_id, "stopped", "interrupted (SIGINT)")
        pipe.shutdown()
        sys.stderr.write(_interrupted(pipe, args) + "\n")
        return 130
    except BaseException as err:  # the store's record of this attempt keeps the cause
        if rm is not None:
            rm.store.end_run(rm.job_id, "failed", repr(err))
        pipe.shutdown()
        if isinstance(err, Exception) and user_error(err):
            return _refuse(err)
        from rollart.rollout.sample_buffer import RolloutError

        if isinstance(err, RolloutError):  # the episodes kept failing: the cause in one line, not a traceback
            log.error("the run stopped: %s", err, exc_info=log.isEnabledFor(logging.DEBUG))
            return 1
        raise
    pipe.shutdown()
    records = pipe.step_records() if hasattr(pipe, "step_records") else history  # every step, not just the kept
    last = records[-1] if records else {}
    metrics, plot = getattr(pipe, "metrics_path", None), getattr(pipe, "plot_path", None)
    cost = _cost_summary(records)
    summary = {
        "steps": len(records),
        "final_reward": last.get("reward_mean"),
        "first_reward": records[0].get("reward_mean") if records else None,
        "output_dir": str(out_dir.resolve()),
        "metrics": str(metrics) if metrics else None,
        "plot": str(plot) if plot else None,
        "hf": str(getattr(pipe, "export_path", None) or "") or None,
        "cost": cost,
        "stopped_at": getattr(pipe, "stopped_at", None),  # stop_at ended the run after this step
    }
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")  # the run finished
    if args.json:  # the summary once, on stdout (the log lines go to stderr)
        sys.stdout.write(json.dumps(summary) + "\n")
    else:
        reward = summary["final_reward"]
        log.info(
            "done: %d steps%s, reward %s at the last step; outputs in %s",
            summary["steps"],
            " (stop_at's reward reached)" if summary["stopped_at"] else "",
            "n/a" if reward is None else f"{reward:.3f}",
            summary["output_dir"],
        )
        if cost["trained_trajectories"]:
            log.info(
                "cost: %.1f device-s held (%s per trained sample), inference busy %.1f worker-s; by task in cost.json",
                cost["device_s_total"],
                f"{cost['device_s_per_trained_sample']:.3g}",
                cost["busy_worker_s"],
            )
    return 0


def _cost_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run summary's cost: the totals of ``cost.json`` (the run's cost from its step records)."""
    from rollart.pipeline.records import run_cost

    full = run_cost(records)
    return {
        "trained_trajectories": full["trained_trajectories"],
        "device_s_total": full["device_s_total"],
        "device_s_per_trained_sample": full["device_s_per_trained_sample"],
        "busy_worker_s": sum(b.get("worker_s", 0.0) for b in full["busy"].values()),
        "busy_device_s": sum(b.get("device_s", 0.0) for b in full["busy"].values()),
        "busy_device_s_per_trained_sample": full["busy_device_s_per_trained_sample"],
    }


def add_run_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="train: run a pipeline from a YAML config",
        description="Run a pipeline config: train, write metrics, checkpoints and the final model to the "
        "config's output_dir. Ctrl-C stops cleanly and prints how to resume.",
    )
    p.add_argument(
        "config", nargs="?", help="pipeline YAML, e.g. pipelines/quickstart.yaml, or the name of a shipped config"
    )
    p.add_argument("--list", action="store_true", help="list the shipped configs (usable by name) and exit")
    p.add_argument(
        "--resume", action="store_true", help="continue the run in the output folder from its last checkpoint"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace the earlier run in the output folder (deletes it first)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted for nested keys, e.g. --set train.lr=0.002); repeatable",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout at the end")
    p.set_defaults(func=cmd_run, parser=p)
