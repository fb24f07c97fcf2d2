"""Per-task shares of a training batch (RollArt paper §7.1; ROLL's "domain batch size").

A job that mixes tasks gives each task tag a ``ratio``; a batch of ``batch_groups`` groups then holds
``batch_groups * ratio / sum(ratios)`` groups of each task — whole groups only (GRPO normalises within
a group), so the ratios must split ``batch_groups`` exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction


def _fraction(x: float) -> Fraction:
    return Fraction(x).limit_denominator(1_000_000)


def ratio_problems(ratios: Mapping[str, float], batch_groups: int, field: str = "tasks") -> list[str]:
    """What keeps ``ratios`` from splitting ``batch_groups`` into whole groups per task (empty if nothing);
    each line names the field and the fix."""
    bad = sorted(t for t, r in ratios.items() if not r > 0)
    if bad:
        return [
            f"{field}.{t}.ratio must be > 0 (got {ratios[t]!r}); give it a positive share or remove the task"
            for t in bad
        ]
    if not ratios:
        return []
    fr = {t: _fraction(r) for t, r in ratios.items()}
    total = sum(fr.values())
    shares = {t: batch_groups * r / total for t, r in fr.items()}
    if all(s.denominator == 1 for s in shares.values()):
        return []
    scale = math.lcm(*(r.denominator for r in fr.values()))
    ints = [int(r * scale) for r in fr.values()]
    step = sum(ints) // math.gcd(*ints)  # the batch sizes that split exactly are multiples of this
    split = " + ".join(f"{t} {float(s):.3g}" for t, s in sorted(shares.items()))
    ratio_text = ":".join(f"{r:g}" for _, r in sorted(ratios.items()))
    lower, upper = batch_groups // step * step, -(-batch_groups // step) * step
    suggestion = f"{lower} or {upper}" if lower else str(upper)
    return [
        f"{field}.*.ratio: {ratio_text} ({', '.join(sorted(ratios))}) splits rollout.batch_groups={batch_groups} "
        f"into {split} groups, but a batch holds whole groups; set rollout.batch_groups to a multiple of {step} "
        f"(e.g. {suggestion}) or change the ratios"
    ]


def ratio_quotas(ratios: Mapping[str, float], batch_groups: int, field: str = "tasks") -> dict[str, int]:
    """Groups per batch of every task; ``ValueError`` (see :func:`ratio_problems`) when they are not whole."""
    problems = ratio_problems(ratios, batch_groups, field)
    if problems:
        raise ValueError("\n".join(problems))
    fr = {t: _fraction(r) for t, r in ratios.items()}
    total = sum(fr.values())
    return {t: int(batch_groups * r / total) for t, r in fr.items()}
