"""rollart bench history: the asv benchmarks match the tracked runs, the committed history is readable
and covers what CI checks, and the check flags a drop beyond the tolerance in the right direction."""

import importlib.util
import inspect
from pathlib import Path

import pytest

from rollart.benchmarks import history as h

ROOT = Path(__file__).resolve().parents[1]


def _ratios_module():
    spec = importlib.util.spec_from_file_location("ratios", ROOT / h.ASV_DIR / "tracked" / "ratios.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_tracked_run_is_an_asv_class_with_its_own_setup_cache_and_one_track_per_value():
    mod = _ratios_module()
    lines = set()
    for t in h.TRACKED:
        cls = getattr(mod, t.name, None)
        if t.missing:
            assert cls is None  # a slot for a bench that does not exist yet records nothing
            continue
        assert cls is not None and cls.run is t
        assert {n for n in dir(cls) if n.startswith("track_")} == {f"track_{v.name}" for v in t.values}
        # asv keys a setup_cache by its source line: classes sharing one would share one bench run
        lines.add(inspect.getsourcelines(cls.setup_cache)[1])
        assert cls.setup_cache.timeout == t.timeout_s
    assert len(lines) == len([t for t in h.TRACKED if not t.missing])


def test_the_committed_history_holds_every_ci_value_of_at_least_two_commits():
    records = h.read_results(ROOT / h.ASV_DIR / "results")
    keys = {(t.name, v.name) for t in h.tracked("ci") for v in t.values}
    complete = [r for r in records if keys <= set(r.values)]
    assert len(complete) >= 2, "record the ci suite: rollart bench history --record --suite ci"
    assert all(v > 0 for r in complete for v in r.values.values())


ENV_ASYNC = [h.by_name("ci_env_async")]


def _rec(commit: str, **values: float) -> h.Record:
    return h.Record(commit, 0, {("ci_env_async", k): v for k, v in values.items()})


def test_a_drop_beyond_the_tolerance_against_the_median_of_the_last_three_is_a_regression():
    history = [_rec("a", speedup=9.0), _rec("b", speedup=2.0), _rec("c", speedup=2.2), _rec("d", speedup=1.9)]
    assert h.reference(history, ("ci_env_async", "speedup")) == pytest.approx(2.0)  # a, the oldest, left out
    full = {"fraction_of_ideal": 0.95}
    lines, bad = h.compare(_rec("now", speedup=1.61, **full), history, 0.2, ENV_ASYNC)
    assert bad == [] and "reference 2.000" in lines[0]
    lines, bad = h.compare(_rec("now", speedup=1.59, **full), history, 0.2, ENV_ASYNC)
    assert len(bad) == 1 and "speedup = 1.590 is more than 20% below the recorded 2.000" in bad[0]
    # a value the run did not produce is a regression too (a bench that broke)
    _, bad = h.compare(_rec("now", speedup=2.0), history, 0.2, ENV_ASYNC)
    assert any("fraction_of_ideal: no value" in b for b in bad)


def test_lower_is_better_values_regress_upwards():
    assert h.dropped(1.3, 1.0, higher_is_better=False, tolerance=0.2)
    assert not h.dropped(0.5, 1.0, higher_is_better=False, tolerance=0.2)
    assert h.dropped(0.7, 1.0, higher_is_better=True, tolerance=0.2)
    assert not h.dropped(1.5, 1.0, higher_is_better=True, tolerance=0.2)


def test_what_a_tracked_run_needs_outside_the_repository_is_found_from_the_folder_asv_runs_it_in(tmp_path):
    """asv runs each bench in a folder of its own: TRL's interpreter, named relative to the checkout, is
    passed to the bench as a path under the checkout the recording started from."""
    run = h.by_name("full_throughput")
    assert run.needs == (".venv-trl/bin/python",)
    argv = h.bench_argv(run, tmp_path)
    trl = argv[argv.index("--trl") + 1]
    assert trl == str(tmp_path / ".venv-trl" / "bin" / "python")
    assert [a for a in argv if a != trl] == [a for a in run.args if a not in run.needs]
