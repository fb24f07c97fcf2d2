"""A :class:`~rollart.planning.partition.Workload` from a short synchronous run's step records.

The run is synchronous (``alpha: 0``), so a step's ``time.rollout_wait_s`` is the generation of its ``N``
samples on the ``k_r`` rollout devices and ``time.train_s + time.weight_sync_s`` is training on the
``k_t`` training devices. Per sample:

- ``mu_gen = k_r * rollout_wait_s / N``: device-seconds to generate one sample at the profiled load
  (it includes the step's tail, so it leans towards more rollout devices);
- ``mu_train = k_t * (train_s + weight_sync_s) / (E * N)``: device-seconds to train on one sample once;
- the shape of the generation times is the trajectories' wall-time quantiles
  (``by_tag.*.trajectory_s_quantiles``), mixed over tags by their trajectory counts, scaled to
  ``mu_gen``; ``L_gen`` is its maximum.

The first ``skip`` steps are left out (model loading, first compilations).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollart.planning.partition import SampleTimes, Workload

QUANTILE_PROBS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)


class ProfileError(ValueError):
    """The records cannot give a workload (too few steps, no timings)."""


@dataclass(frozen=True)
class Measured:
    steps: int
    samples_per_step: int
    rollout_wait_s: float  # median over the steps used
    train_s: float  # median train + weight sync
    trajectory_s_mean: float


def mixed_shape(records: Sequence[dict[str, Any]]) -> SampleTimes | None:
    """The trajectories' wall-time distribution over ``records``: the per-tag quantile functions averaged
    with the tags' trajectory counts as weights (a quantile average, fine for a shape)."""
    acc = [0.0] * len(QUANTILE_PROBS)
    total = 0
    for rec in records:
        for tag in (rec.get("by_tag") or {}).values():
            q, n = tag.get("trajectory_s_quantiles"), int(tag.get("trajectories") or 0)
            if q and n and len(q) == len(QUANTILE_PROBS):
                acc = [a + n * v for a, v in zip(acc, q, strict=True)]
                total += n
    if not total:
        return None
    values = [a / total for a in acc]
    for i in range(1, len(values)):  # rounding can break monotonicity by an ulp
        values[i] = max(values[i], values[i - 1])
    return SampleTimes(QUANTILE_PROBS, tuple(values))


def workload_from_records(
    records: Sequence[dict[str, Any]],
    *,
    rollout_devices: int,
    train_devices: int,
    epochs: int,
    alpha: int,
    skip: int = 1,
) -> tuple[Workload, Measured]:
    """The workload of a synchronous profiling run (see the module docstring)."""
    used = [r for r in records if r.get("step", 0) > skip and "time" in r]  # steps count from 1
    if len(used) < 1:
        raise ProfileError(
            f"the profile has {len(records)} step(s); give --steps above {skip} (the first {skip} skipped)"
        )
    n = int(
        statistics.median(sum(int(t.get("trajectories") or 0) for t in (r.get("by_tag") or {}).values()) for r in used)
    )
    if n <= 0:
        raise ProfileError("the profile's steps trained no trajectories")
    wait = statistics.median(float(r["time"].get("rollout_wait_s") or 0.0) for r in used)
    train = statistics.median(
        float(r["time"].get("train_s") or 0.0) + float(r["time"].get("weight_sync_s") or 0.0) for r in used
    )
    shape = mixed_shape(used)
    mu_gen = rollout_devices * wait / n
    mu_train = train_devices * train / (epochs * n)
    if shape is not None and shape.mean > 0:
        shape = shape.scaled(mu_gen)
        l_gen = shape.max
    else:
        shape, l_gen = None, mu_gen
    means = [
        t["trajectory_s_mean"] for r in used for t in (r.get("by_tag") or {}).values() if t.get("trajectory_s_mean")
    ]
    w = Workload(n, mu_gen, l_gen, mu_train, epochs=epochs, alpha=alpha, shape=shape)
    return w, Measured(len(used), n, wait, train, statistics.mean(means) if means else 0.0)
