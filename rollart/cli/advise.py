"""``rollart advise CONFIG``: how many of the job's devices to train on and how many to generate on.

A short synchronous run of the config (``--steps``, ``rollout.alpha: 0``, no checkpoints, no export)
measures the generation and training time per sample (:mod:`rollart.planning.profile`); from them the
training share beta* of ROLL Flash Prop. 2 (:mod:`rollart.planning.partition`) is computed for the
config's devices (or ``--devices K``) at the config's ``rollout.alpha`` (or ``--alpha``; 1 when the
config is synchronous), then checked against a simulated sweep of every whole split.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollart.config import PipelineConfig

log = logging.getLogger(__name__)


def config_devices(cfg: Any) -> tuple[int, int]:
    """(training devices, rollout devices) of ``cfg``'s pools; one pool for both counts for both."""
    from rollart.resource_manager.specs import parse_pools

    pools = parse_pools(cfg.pools)
    train = sum(g.amount for g in pools[cfg.train_pool].groups)
    rollout = sum(g.amount for g in pools[cfg.rollout_pool].groups)
    return train, rollout


def advise(
    cfg: PipelineConfig, *, steps: int, devices: int | None = None, alpha: int | None = None, out: Path
) -> dict[str, Any]:
    """Profile the job of ``cfg`` and return the advice as a JSON-ready dict. Raises ``ValueError``
    (before anything starts) when there is no split to make."""
    from rollart.cli.run import build_pipeline
    from rollart.planning.partition import advised_split, beta_star, simulate, sweep, sync_bound
    from rollart.planning.profile import workload_from_records

    k_train, k_rollout = config_devices(cfg)
    same_pool = cfg.train_pool == cfg.rollout_pool
    total = devices or (k_train if same_pool else k_train + k_rollout)
    if total < 2:
        raise ValueError(f"devices: {total}; a train/rollout split needs 2 or more (give --devices K)")
    target_alpha = alpha if alpha is not None else (cfg.rollout.alpha or 1)
    if target_alpha < 1:
        raise ValueError("alpha: the split is for asynchronous training; give 1 or more")
    # the same job, synchronous, short, with nothing written but its metrics
    profile_cfg = cfg.model_copy(
        update={
            "steps": steps,
            "rollout": cfg.rollout.model_copy(update={"alpha": 0}),
            "checkpoint_every": 0,
            "output_dir": str(out),
            "export": cfg.export.model_copy(update={"hf": False}),
            "eval": None,
        }
    )
    log.info("profiling %s: %d synchronous step(s) in %s", cfg.name, steps, out)
    pipe = build_pipeline(profile_cfg, progress=False)
    try:
        history = pipe.run()
    finally:
        pipe.shutdown()
    records = pipe.step_records() if hasattr(pipe, "step_records") else history
    w, measured = workload_from_records(
        records,
        rollout_devices=k_rollout,
        train_devices=k_train,
        epochs=cfg.train.ppo_epochs,
        alpha=target_alpha,
    )
    beta = beta_star(w, total)
    k_star = advised_split(w, total)
    table = sweep(w, total)
    best = min(table, key=lambda r: r.simulated_step_s)
    at_star = next(r for r in table if r.train_devices == k_star)
    sync_sim = sum(simulate(w, total, None, seed=s) for s in (0, 1, 2)) / 3
    return {
        "config": cfg.name,
        "devices": total,
        "alpha": target_alpha,
        "profile": {**asdict(measured), "out": str(out)},
        "workload": {k: v for k, v in asdict(w).items() if k != "shape"},
        # the advice is the simulated sweep's best split; beta* (the bound's) is shown beside it
        "advice": {
            # synchronous: every device generates, then every device trains (no split); chosen when the
            # simulation finds it faster than the best split (short generation tails, few devices)
            "mode": "sync" if sync_sim < best.simulated_step_s else "async",
            "train_devices": best.train_devices,
            "rollout_devices": best.rollout_devices,
        },
        "simulated_step_s": {"sync": sync_sim, "async": best.simulated_step_s},
        "bound_step_s": {"sync": sync_bound(w, total), "async": best.bound_step_s},
        "beta_star": beta,
        "beta_star_split": {
            "train_devices": k_star,
            "rollout_devices": total - k_star,
            "simulated_step_s": at_star.simulated_step_s,
            "vs_advice": at_star.simulated_step_s / best.simulated_step_s,
        },
        "sweep": [asdict(r) for r in table],
    }


def cmd_advise(args: argparse.Namespace) -> int:
    from rollart.config import ConfigError, load_config, parse_sets
    from rollart.planning.profile import ProfileError

    if args.steps < 2:
        log.error("rollart advise --steps: give 2 or more (the first step is left out as warm-up)")
        return 2
    if args.alpha is not None and args.alpha < 1:
        log.error("rollart advise --alpha: the split is for asynchronous training; give 1 or more")
        return 2
    if args.devices is not None and args.devices < 2:
        log.error("rollart advise --devices: a train/rollout split needs 2 or more devices")
        return 2
    try:  # every check before anything starts
        cfg = load_config(args.config, parse_sets(args.set))
    except ConfigError as err:
        log.error("%s", err)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="rollart-advise-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = advise(cfg, steps=args.steps, devices=args.devices, alpha=args.alpha, out=out)
    except ProfileError as err:  # the run gave no usable timings
        log.error("rollart advise: %s", err)
        return 1
    except ValueError as err:  # no split to make: refused before anything started
        log.error("rollart advise: %s", err)
        return 2
    (out / "advise.json").write_text(json.dumps(result, indent=2))
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    w, a, star = result["workload"], result["advice"], result["beta_star_split"]
    title = f"rollart advise {cfg.name}: {result['devices']} devices, alpha {result['alpha']}"
    head = Table(title=title, show_header=False)
    head.add_row(
        "per sample",
        f"generate {w['mu_gen'] * 1e3:.2f} ms (longest {w['l_gen'] * 1e3:.1f} ms), "
        f"train {w['mu_train'] * 1e3:.2f} ms x {w['epochs']} epoch(s)",
    )
    head.add_row("samples per step", str(w["samples_per_step"]))
    if a["mode"] == "sync":
        head.add_row(
            "advice",
            f"stay synchronous on all {result['devices']} (the best split, {a['train_devices']} training and "
            f"{a['rollout_devices']} generating, is slower)",
        )
    else:
        head.add_row("advice", f"{a['train_devices']} training, {a['rollout_devices']} generating")
    sim = result["simulated_step_s"]
    head.add_row(
        "step (simulated)", f"{sim['async']:.3f} s; synchronous on all {result['devices']}: {sim['sync']:.3f} s"
    )
    head.add_row(
        "beta* (Prop. 2 bound)",
        f"{result['beta_star']:.3f}: {star['train_devices']} training, simulated {star['vs_advice']:.3f}x the advice",
    )
    console = Console()
    console.print(head)
    sw = Table(title="simulated sweep")
    for c in ("training", "generating", "simulated s/step", "bound s/step"):
        sw.add_column(c)
    for r in result["sweep"]:
        mark = " <" if r["train_devices"] == a["train_devices"] else ""
        sw.add_row(
            str(r["train_devices"]),
            str(r["rollout_devices"]),
            f"{r['simulated_step_s']:.3f}{mark}",
            f"{r['bound_step_s']:.3f}",
        )
    console.print(sw)
    return 0


def add_advise_parser(sub: Any) -> None:
    p = sub.add_parser("advise", help="profile a config briefly and advise the train/rollout device split")
    p.add_argument("config", help="pipeline YAML or a shipped name")
    p.add_argument("--steps", type=int, default=6, help="synchronous profiling steps (the first is left out)")
    p.add_argument("--devices", type=int, default=None, help="plan for this many devices (default: the config's)")
    p.add_argument(
        "--alpha", type=int, default=None, help="asynchrony bound to plan for (default: the config's, 1 if 0)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted for nested keys); repeatable",
    )
    p.add_argument(
        "--out", default=None, help="profiling run folder (default: a new temporary one); advise.json goes there"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_advise)
