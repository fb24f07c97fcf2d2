"""history: the ratios the benches report, recorded per commit with airspeed velocity (asv), shown per
commit, and checked against the recorded history.

What is tracked (:data:`TRACKED`) is the ratios each bench reports — speedups and their fraction of the
bench's own bound — never absolute times: two modes measured side by side in one run slow down together
on a loaded machine, so their ratio holds where a wall time does not. Two suites:

- ``full``: the benches at the sizes of their published figures (minutes each; record them on an idle
  machine): ``env-async``, ``redundant-env``, ``queue-scheduling``, ``prompt-replication``,
  ``async-train``, ``throughput`` (with ``--trl``: rollart against TRL) and ``startup``;
- ``ci``: the fast benches at small sizes (about two minutes together on 2 cores), what
  ``scripts/test.sh`` checks.

The history is asv's results folder ``asv_bench/results/<machine>/``, one JSON file per commit, committed
to the repository; asv runs the benches in this environment (``-E existing:<this python>``), so nothing
is built per commit. ``--record`` runs a suite for the checked-out commit and stores its values;
``--show`` prints them per commit and flags every value that fell more than ``--tolerance`` below the
median of the (up to) three commits recorded before it (above it, for a value where lower is better);
``--check`` runs the ``ci`` suite into a scratch folder and fails (exit 1) on such a drop against the
recorded history of the commit's ancestors. asv's own commands read the same folder
(``asv --config asv_bench/asv.conf.json show`` / ``publish`` / ``preview``); they take a lower value as
better, which holds for none of the speedups here, so read drops from ``--show``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
ROOT_ENV = "ROLLART_HISTORY_ROOT"  # the checkout a recording runs from (set for the benches asv runs)

MACHINE = "2core-cpu"  # the machine kind the project is developed and CI-tested on
TOLERANCE = 0.2  # a drop of more than 20% against the median of the last three recorded values
REFERENCE_COMMITS = 3
ASV_DIR = "asv_bench"  # asv.conf.json, the benchmark module asv runs, results/ (the recorded history)


@dataclass(frozen=True)
class Value:
    """One tracked value of a bench's result: ``get(result)``; ``higher_is_better`` gives the direction
    of a regression."""

    name: str
    get: Callable[[Mapping[str, Any]], float]
    higher_is_better: bool = True
    doc: str = ""


def _key(key: str) -> Callable[[Mapping[str, Any]], float]:
    return lambda r: float(r[key])


def _over(num: str, den: str) -> Callable[[Mapping[str, Any]], float]:
    return lambda r: float(r[num]) / float(r[den])


def _alpha(alpha: str, key: str) -> Callable[[Mapping[str, Any]], float]:
    return lambda r: float(r["per_alpha"][alpha][key])


@dataclass(frozen=True)
class Tracked:
    """A bench run (``rollart bench BENCH *ARGS``) and the values taken from its result. ``name`` is the
    asv benchmark class (``<suite>_<bench>``); ``missing`` says why the bench cannot run here yet."""

    suite: str
    bench: str
    args: tuple[str, ...]
    values: tuple[Value, ...]
    timeout_s: float = 1800.0
    missing: str | None = None
    needs: tuple[str, ...] = field(default_factory=tuple)  # what the run needs beyond the repository

    @property
    def name(self) -> str:
        return f"{self.suite}_{self.bench.replace('-', '_')}"


SPEEDUP = Value("speedup", _key("speedup"), doc="the bench's measured speedup")
OF_IDEAL = Value("fraction_of_ideal", _key("fraction_of_ideal"), doc="speedup / ideal speedup")
OF_MODEL = Value("fraction_of_model", _over("speedup", "model_speedup"), doc="speedup / modelled speedup")

TRACKED: tuple[Tracked, ...] = (
    # ---- ci: the fast benches at small sizes (scripts/test.sh runs --check over them)
    Tracked(
        "ci",
        "env-async",
        ("--mean", "10", "--std", "10", "--batch", "64", "--turns", "10"),
        (SPEEDUP, OF_IDEAL),
        timeout_s=300,
    ),
    Tracked("ci", "queue-scheduling", ("--repeats", "1", "--time-scale", "0.1"), (SPEEDUP, OF_MODEL), timeout_s=300),
    # ---- full: the published settings
    Tracked("full", "env-async", ("--mean", "10", "--std", "10", "--batch", "512"), (SPEEDUP, OF_IDEAL)),
    Tracked("full", "redundant-env", (), (SPEEDUP, OF_MODEL)),
    Tracked("full", "queue-scheduling", (), (SPEEDUP, OF_MODEL)),
    Tracked("full", "prompt-replication", (), (SPEEDUP, OF_MODEL)),
    Tracked(
        "full",
        "async-train",
        (),
        (
            Value("alpha1_step_vs_sync", _alpha("1", "ratio_to_sync"), False, "α=1 step time / α=0 step time"),
            Value("alpha2_step_vs_sync", _alpha("2", "ratio_to_sync"), False, "α=2 step time / α=0 step time"),
            Value("alpha1_over_bound", _alpha("1", "measured_over_bound"), False, "α=1 step time / its bound"),
        ),
        timeout_s=3600,
    ),
    Tracked(
        "full",
        "throughput",
        ("--trl", ".venv-trl/bin/python", "--trl-threads", "1"),
        (
            Value("sync_vs_trl", _key("rollart alpha 0 / best TRL"), doc="α=0 samples/s / TRL's"),
            Value("alpha1_vs_trl", _key("rollart alpha 1 / best TRL"), doc="α=1 samples/s / TRL's"),
        ),
        timeout_s=7200,
        needs=(".venv-trl/bin/python",),
    ),
    Tracked(
        "full",
        "startup",
        ("--repeats", "3"),
        (
            # a run's CPU seconds hardly change with the machine's load (its wall time does, several-fold);
            # over a bare Ray program's, measured just before it, Ray's own cost and the CPU's speed cancel
            Value("cpu_vs_bare_ray", _key("cpu_over_bare"), False, "CPU s to the first step / a bare Ray program's"),
            Value(
                "first_step_vs_bare_ray",
                _key("first_step_over_bare"),
                False,
                "seconds to the first step / a bare Ray program's to its first actor call",
            ),
        ),
        timeout_s=1800,
    ),
)


def by_name(name: str) -> Tracked:
    """The tracked run named ``name`` (``<suite>_<bench>``)."""
    return next(t for t in TRACKED if t.name == name)


def tracked(suite: str | None = None, only: Sequence[str] = ()) -> list[Tracked]:
    """The tracked runs of ``suite`` (all when None), limited to the benches in ``only``."""
    return [t for t in TRACKED if (suite in (None, "all", t.suite)) and (not only or t.bench in only)]


def bench_argv(t: Tracked, root: Path) -> list[str]:
    """The bench's arguments, with what it needs beyond the repository (TRL's interpreter, named relative
    to the checkout) made absolute against ``root``: asv runs the bench in a folder of its own."""
    return [str(root / a) if a in t.needs else a for a in t.args]


def measure(t: Tracked) -> dict[str, float]:
    """Run one tracked bench in this process and return its values by name."""
    from rollart.benchmarks import load_bench

    if t.missing:
        raise RuntimeError(t.missing)
    mod = load_bench(t.bench)
    parser = argparse.ArgumentParser(prog=f"rollart bench {t.bench}")
    mod.add_arguments(parser)
    argv = bench_argv(t, Path(os.environ.get(ROOT_ENV) or os.getcwd()))
    with tempfile.TemporaryDirectory(prefix="rollart-history-") as out:
        args = parser.parse_args([*argv, "--out", out])
        result = mod.run(args)
    if result.get("error"):
        raise RuntimeError(f"rollart bench {t.bench} failed: {result['error']}")
    return {v.name: v.get(result) for v in t.values}


# ---------------------------------------------------------------------- asv: record and read
def repo_root() -> Path:
    out = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _asv_config(root: Path, results_dir: Path | None = None, scratch: Path | None = None) -> Path:
    """The repository's asv config, or a copy of it writing to ``results_dir`` (the check's scratch)."""
    conf = root / ASV_DIR / "asv.conf.json"
    if results_dir is None:
        return conf
    data = json.loads(conf.read_text())
    data.update(
        repo=str(root),
        benchmark_dir=str(root / ASV_DIR / data["benchmark_dir"]),
        results_dir=str(results_dir),
        html_dir=str(results_dir / "html"),
    )
    assert scratch is not None
    path = scratch / "asv.conf.json"
    path.write_text(json.dumps(data))
    return path


def run_asv(root: Path, suite: str, only: Sequence[str], results_dir: Path | None = None) -> None:
    """``asv run`` for the checked-out commit over the tracked runs of ``suite``, in this Python."""
    runs = [t for t in tracked(suite, only) if not t.missing]
    for t in tracked(suite, only):
        if t.missing:
            log.warning("%s: %s", t.name, t.missing)
    absent = [n for t in runs for n in t.needs if not (root / n).exists()]
    if absent:
        raise SystemExit(f"history: {', '.join(absent)} missing (see docs/benchmarks.md); leave that bench out")
    if not runs:
        raise SystemExit(f"history: nothing to run in suite {suite!r} for {list(only)}")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
    with tempfile.TemporaryDirectory(prefix="rollart-asv-") as scratch:
        # asv's machine file (~/.asv-machine.json) stays in the scratch; the benches learn the checkout
        env = {**os.environ, "HOME": scratch, ROOT_ENV: str(root)}
        conf = _asv_config(root, results_dir, Path(scratch))
        asv = [sys.executable, "-m", "asv", "--config", str(conf)]
        subprocess.run([*asv, "machine", "--yes", "--machine", MACHINE], env=env, cwd=root, check=True)
        pattern = "^ratios\\.(" + "|".join(t.name for t in runs) + ")\\."
        done = subprocess.run(
            [
                *asv,
                "run",
                "-E",
                f"existing:{sys.executable}",
                "--set-commit-hash",
                commit.stdout.strip(),
                "--machine",
                MACHINE,
                "--bench",
                pattern,
                "--show-stderr",
            ],
            env=env,
            cwd=root,
        )
        if done.returncode != 0:
            raise SystemExit(f"history: asv run failed (exit {done.returncode})")


@dataclass
class Record:
    """The tracked values asv recorded for one commit (``values[(class, value)]``)."""

    commit: str
    date: int
    values: dict[tuple[str, str], float]


def read_results(results_dir: Path, machine: str = MACHINE) -> list[Record]:
    """Every commit recorded for ``machine`` under ``results_dir`` (all environments merged)."""
    from asv.results import iter_results_for_machine

    by_commit: dict[str, Record] = {}
    if not (results_dir / machine).is_dir():
        return []
    for res in iter_results_for_machine(str(results_dir), machine):
        rec = by_commit.setdefault(res.commit_hash, Record(res.commit_hash, res.date or 0, {}))
        for key in res.get_all_result_keys():
            module, _, rest = key.partition(".")
            cls, _, method = rest.partition(".")
            if module != "ratios" or not method.startswith("track_"):
                continue
            value = res.get_result_value(key, res.get_result_params(key))
            if value and value[0] is not None and not math.isnan(value[0]):
                rec.values[(cls, method[len("track_") :])] = float(value[0])
    return list(by_commit.values())


def _git_order(root: Path, commits: Sequence[str]) -> list[str]:
    """``commits`` oldest first: HEAD's ancestors in history order, the others after them by hash."""
    out = subprocess.run(["git", "rev-list", "--reverse", "HEAD"], cwd=root, capture_output=True, text=True)
    order = {c: i for i, c in enumerate(out.stdout.split())}
    return sorted(commits, key=lambda c: (c not in order, order.get(c, 0), c))


def _subject(root: Path, commit: str) -> str:
    out = subprocess.run(["git", "log", "-1", "--format=%s", commit], cwd=root, capture_output=True, text=True)
    return (out.stdout.strip() or "(not in this clone)")[:100]


def value_spec(cls: str, value: str) -> Value | None:
    for t in TRACKED:
        if t.name == cls:
            return next((v for v in t.values if v.name == value), None)
    return None


def dropped(value: float, reference: float, higher_is_better: bool, tolerance: float) -> bool:
    """Whether ``value`` is worse than ``reference`` by more than ``tolerance`` (a fraction of it)."""
    if higher_is_better:
        return value < reference * (1 - tolerance)
    return value > reference * (1 + tolerance)


def reference(history: Sequence[Record], key: tuple[str, str]) -> float | None:
    """The median of the last :data:`REFERENCE_COMMITS` recorded values of ``key`` in ``history``."""
    seen = [r.values[key] for r in history if key in r.values][-REFERENCE_COMMITS:]
    return statistics.median(seen) if seen else None


def show(root: Path, results_dir: Path, tolerance: float, suite: str | None) -> dict[str, Any]:
    records = {r.commit: r for r in read_results(results_dir)}
    ordered = [records[c] for c in _git_order(root, list(records))]
    known = {(t.name, v.name) for t in tracked(suite) for v in t.values}  # runs no longer tracked: left out
    keys = sorted({k for r in ordered for k in r.values if k in known})
    rows, flagged = [], []
    for i, rec in enumerate(ordered):
        row: dict[str, Any] = {"commit": rec.commit[:10], "subject": _subject(root, rec.commit)}
        for key in keys:
            if key not in rec.values:
                continue
            spec = value_spec(*key)
            ref = reference(ordered[:i], key)
            mark = ""
            if spec is not None and ref is not None and dropped(rec.values[key], ref, spec.higher_is_better, tolerance):
                mark = " DROP"
                flagged.append(f"{rec.commit[:10]} {key[0]}.{key[1]} {rec.values[key]:.3f} (reference {ref:.3f})")
            row[f"{key[0]}.{key[1]}"] = f"{rec.values[key]:.3f}{mark}"
        rows.append(row)
    return {"rows": rows, "columns": [f"{c}.{v}" for c, v in keys], "drops": flagged}


def compare(
    now: Record, history: Sequence[Record], tolerance: float, runs: Sequence[Tracked] | None = None
) -> tuple[list[str], list[str]]:
    """``now``'s values of ``runs`` (default: the ``ci`` suite) against the reference of ``history``
    (oldest first): a line per value, and the regressions (a drop beyond ``tolerance``, or a value the
    run did not produce)."""
    lines, regressions = [], []
    for t in tracked("ci") if runs is None else runs:
        for v in t.values:
            key = (t.name, v.name)
            value, ref = now.values.get(key), reference(history, key)
            if value is None:
                regressions.append(f"{t.name}.{v.name}: no value (the bench failed; asv's output above says why)")
                continue
            if ref is None:
                lines.append(f"{t.name}.{v.name} = {value:.3f} (nothing recorded yet)")
                continue
            bad = dropped(value, ref, v.higher_is_better, tolerance)
            lines.append(f"{t.name}.{v.name} = {value:.3f}, reference {ref:.3f}{'  REGRESSION' if bad else ''}")
            if bad:
                regressions.append(
                    f"{t.name}.{v.name} = {value:.3f} is more than {tolerance:.0%} "
                    f"{'below' if v.higher_is_better else 'above'} the recorded {ref:.3f}"
                )
    return lines, regressions


def reference_history(root: Path, results_dir: Path) -> tuple[list[Record], str]:
    """The recorded commits the check compares against, oldest first: HEAD's recorded ancestors (HEAD's
    own record left out); when none is an ancestor (a rebased branch), every other recorded commit, by
    date. With a note saying which."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
    head_hash = head.stdout.strip()
    every = [r for r in read_results(results_dir) if r.commit != head_hash]
    ancestors = set(
        subprocess.run(["git", "rev-list", "HEAD"], cwd=root, capture_output=True, text=True).stdout.split()
    )
    mine = {r.commit: r for r in every if r.commit in ancestors}
    if mine:
        return [mine[c] for c in _git_order(root, list(mine))], "HEAD's recorded ancestors"
    return sorted(every, key=lambda r: r.date), "no recorded ancestor of HEAD: every recorded commit, by date"


def check(root: Path, results_dir: Path, tolerance: float) -> dict[str, Any]:
    """Run the ``ci`` suite for HEAD into a scratch folder and compare it with :func:`compare`."""
    history, source = reference_history(root, results_dir)
    with tempfile.TemporaryDirectory(prefix="rollart-history-check-") as scratch:
        run_asv(root, "ci", (), Path(scratch))
        now = read_results(Path(scratch))
    if not now:
        raise SystemExit("history --check: asv recorded nothing")
    lines, regressions = compare(now[0], history, tolerance)
    return {"values": [f"reference: {source}", *lines], "regressions": regressions}


# ---------------------------------------------------------------------- the bench interface
def add_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group()
    what.add_argument("--show", action="store_true", help="print the recorded values per commit (the default)")
    what.add_argument("--record", action="store_true", help="run a suite for the checked-out commit and record it")
    what.add_argument(
        "--check", action="store_true", help="run the ci suite and fail on a drop beyond --tolerance (CI runs it)"
    )
    p.add_argument(
        "--suite", default="all", choices=["ci", "full", "all"], help="which tracked runs (--record, --show)"
    )
    p.add_argument("--only", default="", help="comma-separated bench names to record (e.g. env-async,throughput)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help="a drop beyond this fraction is a regression")
    p.add_argument("--last", type=int, default=8, help="commits shown (--show)")
    p.add_argument("--results", default=None, help=f"the recorded history (default: {ASV_DIR}/results)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = repo_root()
    results = Path(args.results) if args.results else root / ASV_DIR / "results"
    only = [b for b in args.only.split(",") if b]
    if args.record:
        run_asv(root, args.suite, only, None if args.results is None else results)
        return {"bench": "history", "recorded": [t.name for t in tracked(args.suite, only) if not t.missing]}
    if args.check:
        out = check(root, results, args.tolerance)
        result: dict[str, Any] = {"bench": "history", "tolerance": args.tolerance, "values": "\n".join(out["values"])}
        if out["regressions"]:
            result["error"] = "; ".join(out["regressions"])
        return result
    table = show(root, results, args.tolerance, None if args.suite == "all" else args.suite)
    if not args.json:
        _print_table(table, args.tolerance, args.last)
    return {"bench": "history", "tolerance": args.tolerance, "drops": "\n".join(table["drops"]) or "none"}


def _print_table(table: Mapping[str, Any], tolerance: float, last: int) -> None:
    """One row per tracked value, one column per commit (the last ``last``, oldest first)."""
    from rich.console import Console
    from rich.table import Table

    rows = table["rows"][-last:]
    out = Table(title=f"recorded ratios per commit ({MACHINE}; DROP: > {tolerance:.0%} worse than the last 3)")
    out.add_column("tracked value")
    for row in rows:
        out.add_column(row["commit"][:8], justify="right")
    for col in table["columns"]:
        out.add_row(col, *(row.get(col, "") for row in rows))
    console = Console()
    console.print(out)
    for row in rows:
        console.print(f"  {row['commit'][:8]}  {row['subject']}")
