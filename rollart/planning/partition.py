"""The train/rollout split of a fixed set of devices (ROLL Flash, Prop. 2), and a discrete-event simulation
to check it.

``K`` devices; an asynchronous job puts ``(1 - beta) K`` of them on generation and ``beta K`` on
training. With ``N`` samples per step, ``E`` passes over each sample in training, ``mu_gen`` the mean
device time to generate one sample (``L_gen`` the longest), ``mu_train`` the device time to train on
one sample once, and ``alpha`` the asynchrony bound:

    T_sync  <= N/K (mu_gen + E mu_train) + L_gen
    T_async <= max(N mu_gen / ((1 - beta) K) + L_gen / ((alpha + 1)(1 - beta)),  E N mu_train / (beta K))
    beta*    = E N mu_train / (N mu_gen + K L_gen / (alpha + 1) + E N mu_train)

:func:`simulate` runs the same model step by step instead of bounding it: queue scheduling of
samples on the generation devices (a device takes the next sample as soon as it is free), sample
times drawn from a measured distribution, a sample of step ``s`` started only once the trainer has
finished step ``s - alpha - 1`` (the staleness bound), and a step trained once all its samples are done
and the previous step is trained. :func:`sweep` runs it for every whole split.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SampleTimes:
    """A distribution of per-sample generation times given by quantiles: ``values[i]`` at probability
    ``probs[i]`` (``probs`` rising from 0 to 1), linear between them."""

    probs: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.probs) != len(self.values) or len(self.probs) < 2:
            raise ValueError("SampleTimes needs as many probs as values, at least two")
        if self.probs[0] != 0.0 or self.probs[-1] != 1.0 or list(self.probs) != sorted(self.probs):
            raise ValueError("SampleTimes.probs must rise from 0.0 to 1.0")
        if any(v < 0 for v in self.values) or list(self.values) != sorted(self.values):
            raise ValueError("SampleTimes.values must be >= 0 and rising")

    @classmethod
    def constant(cls, value: float) -> SampleTimes:
        return cls((0.0, 1.0), (value, value))

    def at(self, p: float) -> float:
        i = min(max(bisect.bisect_right(self.probs, p) - 1, 0), len(self.probs) - 2)
        p0, p1 = self.probs[i], self.probs[i + 1]
        v0, v1 = self.values[i], self.values[i + 1]
        return v0 if p1 == p0 else v0 + (v1 - v0) * (p - p0) / (p1 - p0)

    @property
    def mean(self) -> float:
        """The exact mean of the piecewise-linear quantile function."""
        return sum(
            (p1 - p0) * (v0 + v1) / 2
            for p0, p1, v0, v1 in zip(self.probs, self.probs[1:], self.values, self.values[1:], strict=False)
        )

    @property
    def max(self) -> float:
        return self.values[-1]

    def scaled(self, mean: float) -> SampleTimes:
        """The same shape with mean ``mean``."""
        m = self.mean
        if m <= 0:
            return SampleTimes.constant(mean)
        return SampleTimes(self.probs, tuple(v * mean / m for v in self.values))


@dataclass(frozen=True)
class Workload:
    """What one training step costs, in device-seconds (see the module docstring)."""

    samples_per_step: int  # N
    mu_gen: float  # mean device-seconds to generate one sample
    l_gen: float  # the longest sample's generation time (seconds)
    mu_train: float  # device-seconds to train on one sample once
    epochs: int = 1  # E
    alpha: int = 1
    shape: SampleTimes | None = field(default=None)  # the generation-time distribution (mean mu_gen)

    def times(self) -> SampleTimes:
        """The per-sample generation times the simulation draws from: ``shape`` scaled to ``mu_gen``,
        or, without one, a straight line from 0 to ``l_gen`` bent to keep the mean (two segments)."""
        if self.shape is not None:
            return self.shape.scaled(self.mu_gen)
        if self.l_gen <= self.mu_gen:
            return SampleTimes.constant(self.mu_gen)
        # two segments: [0, m'] up to probability q, then to l_gen; mean = mu_gen picks q
        lo = min(self.mu_gen, self.l_gen / 2)
        # mean = q * lo / 2 + (1 - q) * (lo + l_gen) / 2  => q
        q = ((lo + self.l_gen) / 2 - self.mu_gen) / ((lo + self.l_gen) / 2 - lo / 2)
        q = min(max(q, 0.0), 1.0)
        if q in (0.0, 1.0):
            return SampleTimes.constant(self.mu_gen)
        return SampleTimes((0.0, q, 1.0), (0.0, lo, self.l_gen))


def beta_star(w: Workload, devices: int) -> float:
    """The training share of ``devices`` that balances the two sides of the async bound (eq. 10)."""
    train = w.epochs * w.samples_per_step * w.mu_train
    gen = w.samples_per_step * w.mu_gen + devices * w.l_gen / (w.alpha + 1)
    return train / (gen + train) if gen + train > 0 else 0.5


def async_bound(w: Workload, devices: int, train_devices: int) -> float:
    """The upper bound on one asynchronous step with ``train_devices`` of ``devices`` training (eq. 9)."""
    gen_devices = devices - train_devices
    if not 0 < train_devices < devices:
        raise ValueError(f"train_devices must be in 1..{devices - 1}, got {train_devices}")
    n = w.samples_per_step
    gen = n * w.mu_gen / gen_devices + w.l_gen * devices / ((w.alpha + 1) * gen_devices)
    return max(gen, w.epochs * n * w.mu_train / train_devices)


def sync_bound(w: Workload, devices: int) -> float:
    """The upper bound on one synchronous step, every device generating then training (eq. 8)."""
    n = w.samples_per_step
    return n / devices * (w.mu_gen + w.epochs * w.mu_train) + w.l_gen


def advised_split(w: Workload, devices: int) -> int:
    """Whole training devices nearest ``beta* * devices``, at least one on each side."""
    if devices < 2:
        raise ValueError("a train/rollout split needs at least 2 devices")
    return min(max(round(beta_star(w, devices) * devices), 1), devices - 1)


def simulate(w: Workload, devices: int, train_devices: int | None, *, steps: int = 60, seed: int = 0) -> float:
    """Mean seconds per step over ``steps`` simulated steps (the first ``steps // 6`` not counted: the
    pipeline filling). ``train_devices=None`` is the synchronous schedule on all ``devices``."""
    rng = random.Random(seed)
    dist = w.times()
    n = w.samples_per_step
    warm = steps // 6
    if train_devices is None:
        gen_devices, train_s, alpha = devices, w.epochs * n * w.mu_train / devices, 0
    else:
        if not 0 < train_devices < devices:
            raise ValueError(f"train_devices must be in 1..{devices - 1}, got {train_devices}")
        gen_devices, train_s, alpha = devices - train_devices, w.epochs * n * w.mu_train / train_devices, w.alpha
    free = [0.0] * gen_devices  # when each generation device is next free (a heap)
    trained: list[float] = []  # when the trainer finished each step
    for s in range(steps):
        # synchronous: the devices train after generating, so generation waits for the step before;
        # asynchronous: a sample of step s needs the weights of step s - alpha - 1
        if train_devices is None:
            gate = trained[s - 1] if s >= 1 else 0.0
        else:
            gate = trained[s - alpha - 1] if s - alpha - 1 >= 0 else 0.0
        ready = 0.0
        for _ in range(n):
            start = max(heapq.heappop(free), gate)
            end = start + dist.at(rng.random())
            heapq.heappush(free, end)
            ready = max(ready, end)
        if train_devices is None:  # every device trains once every sample is in
            done = ready + train_s
            free = [done] * gen_devices
        else:
            done = max(ready, trained[-1] if trained else 0.0) + train_s
        trained.append(done)
    start = trained[warm - 1] if warm >= 1 else 0.0
    return (trained[-1] - start) / (steps - warm)


@dataclass(frozen=True)
class SplitResult:
    train_devices: int
    rollout_devices: int
    simulated_step_s: float
    bound_step_s: float


def sweep(w: Workload, devices: int, *, steps: int = 60, seeds: Sequence[int] = (0, 1, 2)) -> list[SplitResult]:
    """:func:`simulate` (averaged over ``seeds``) and :func:`async_bound` for every whole split."""
    out = []
    for k in range(1, devices):
        sim = sum(simulate(w, devices, k, steps=steps, seed=s) for s in seeds) / len(seeds)
        out.append(SplitResult(k, devices - k, sim, async_bound(w, devices, k)))
    return out
