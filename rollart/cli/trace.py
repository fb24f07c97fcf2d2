"""``rollart trace RUN_DIR [TRAJ_ID] [--tag T] [--status trained|failed|dropped|open] [--cost] [--json]``: a
run's trajectory traces (``RUN_DIR/traces.jsonl``): the traced trajectories with their outcome and duration,
their cost per tag and outcome, or one trajectory's life as a timeline."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

OUTCOMES = ("trained", "failed", "dropped", "open")


def _detail(life: Any) -> str:
    end = life.end
    if end is None:
        return ""
    if end["event"] == "trained":
        return f"step {end['step']}, staleness {end['staleness']}, reward {end.get('reward')}"
    return str(end.get("reason") or end.get("error") or end["event"])


def cmd_trace(args: argparse.Namespace) -> int:
    from rollart.tracking.traces import TRACES, lives, read_traces, timeline

    path = Path(args.run_dir) / TRACES
    if not path.is_file():
        log.error(
            "rollart trace: %s holds no %s; give a run's output folder (traces: {enabled: true} writes it)",
            args.run_dir,
            TRACES,
        )
        return 2
    found = lives(read_traces(path))
    if args.traj_id is not None:
        mine = [life for life in found if life.traj_id == args.traj_id]
        if not mine:
            log.error(
                "rollart trace: no trajectory %s in %s (it was not traced: traces.sample, traces.max_mb); "
                "`rollart trace %s` lists the traced ones",
                args.traj_id,
                path,
                args.run_dir,
            )
            return 2
        for life in mine:
            if args.json:
                sys.stdout.write("".join(json.dumps(e) + "\n" for e in life.events))
            else:
                sys.stdout.write(timeline(life) + "\n")
        return 0
    chosen = [
        life
        for life in found
        if (args.tag is None or life.tag == args.tag) and (args.status is None or life.outcome == args.status)
    ]
    if args.cost:
        return _print_cost(chosen, args.json)
    if args.json:
        rows = [
            {"traj_id": x.traj_id, "tag": x.tag, "outcome": x.outcome, "duration_s": x.duration_s, "end": x.end}
            for x in chosen
        ]
        sys.stdout.write("".join(json.dumps(r) + "\n" for r in rows))
        return 0
    width = max([len(x.traj_id) for x in chosen] + [len("trajectory")])
    tags = max([len(x.tag) for x in chosen] + [len("tag")])
    lines = [f"{'trajectory':<{width}} {'tag':<{tags}} {'outcome':<8} {'duration':>9}  detail"]
    lines += [
        f"{x.traj_id:<{width}} {x.tag:<{tags}} {x.outcome:<8} {x.duration_s:>8.3f}s  {_detail(x)}".rstrip()
        for x in chosen
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _print_cost(chosen: list[Any], as_json: bool) -> int:
    from rollart.tracking.traces import cost_table

    rows = cost_table(chosen)
    if as_json:
        sys.stdout.write("".join(json.dumps(r) + "\n" for r in rows))
        return 0
    tags = max([len(r["tag"]) for r in rows] + [len("tag")])
    head = f"{'tag':<{tags}} {'outcome':<8} {'trajs':>6} {'worker_s':>10} {'device_s':>10} {'env_s':>9} {'reward_s':>9}"
    lines = [head]
    lines += [
        f"{r['tag']:<{tags}} {r['outcome']:<8} {r['trajectories']:>6} {r['worker_s']:>10.3f} {r['device_s']:>10.3f} "
        f"{r['env_s']:>9.3f} {r['reward_s']:>9.3f}"
        for r in rows
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def add_trace_parser(sub: Any) -> None:
    p = sub.add_parser("trace", help="show a run's trajectory traces: the list, or one trajectory's timeline")
    p.add_argument("run_dir", help="the run's output folder (output_dir of its config, e.g. runs/quickstart)")
    p.add_argument("traj_id", nargs="?", default=None, help="a trajectory id (group:round:member:vVERSION)")
    p.add_argument("--tag", default=None, help="only the trajectories of this task tag")
    p.add_argument("--status", choices=OUTCOMES, default=None, help="only the trajectories with this outcome")
    p.add_argument("--json", action="store_true", help="print JSON lines (the events, or one row per trajectory)")
    p.add_argument(
        "--cost",
        action="store_true",
        help="what the traced trajectories cost, summed per tag and outcome (worker, device, env, reward seconds)",
    )
    p.set_defaults(func=cmd_trace)
