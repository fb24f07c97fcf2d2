"""Automatic hardware affinity: route each task tag by its measured prefill/decode profile (RollArt paper P1).

The ``@hw_mapping`` preferences are the default and the bounds: for a tag, the automatic order only
reorders the hardware types its static preference lists, never adds one. Once a tag has ``min_requests``
finished requests, its mean prompt and answer lengths give its device time on each hardware type from
that type's roofline (:mod:`rollart.engines.hardware`): prefill compute-bound, decode bandwidth-bound at
a reference batch of ``batch`` running sequences. A tag's score on a type is that time over the
geometric mean of every profiled tag's time on the same type (comparative advantage): the prefill-heavy
tag comes out cheapest on H800 *relative to the other tags*, the decode-heavy one on H20, whatever the
absolute speeds. The tag's order is its types by rising score, ties kept in the static order.

A tag stays on its static order while it has too few requests, when it is the only profiled tag (no
comparison to make), or when one of its types has no profile (CPU or an unknown accelerator).
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rollart.engines.hardware import HARDWARE, HardwareProfile, ModelShape, profile_for
from rollart.rollout.config import RoutingConfig

log = logging.getLogger(__name__)


@dataclass
class TaskShapeStats:
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def prompt(self) -> float:
        return self.prompt_tokens / self.requests if self.requests else 0.0

    @property
    def answer(self) -> float:
        return self.output_tokens / self.requests if self.requests else 0.0


def request_time_s(profile: HardwareProfile, prompt: float, answer: float, batch: int) -> float:
    """Device seconds of one request on ``profile``: its prefill, then ``answer`` decode steps in a batch
    of ``batch`` (its share of the weight read, its own KV cache at the mean context, or its FLOPs)."""
    context = prompt + answer / 2
    decode = max(profile.prefill_s_per_token, profile.decode_weights_s / batch + context * profile.kv_s_per_token)
    return prompt * profile.prefill_s_per_token + answer * decode


class AutoAffinity:
    """Per-tag task shapes (bounded: three counters a tag) and the hardware order they imply."""

    def __init__(self, static: Callable[[str], tuple[str, ...]], config: RoutingConfig | None = None):
        self.static = static
        self.config = config or RoutingConfig()
        model = ModelShape(params=self.config.params, kv_bytes_per_token=self.config.kv_bytes_per_token)
        self.profiles = {hw: profile_for(hw, model) for hw in HARDWARE}
        self.stats: dict[str, TaskShapeStats] = {}
        self._orders: dict[str, tuple[str, ...]] = {}  # the tags whose order differs from the static one
        self._lock = threading.Lock()

    def observe(self, tag: str, prompt_tokens: int, output_tokens: int) -> None:
        """One finished request of ``tag``; the orders are recomputed when a tag becomes profiled."""
        with self._lock:
            s = self.stats.setdefault(tag, TaskShapeStats())
            s.requests += 1
            s.prompt_tokens += prompt_tokens
            s.output_tokens += output_tokens
            if s.requests % self.config.min_requests == 0:  # profiled now, or min_requests more since
                self._recompute()

    def _recompute(self) -> None:
        profiled = {t: s for t, s in self.stats.items() if s.requests >= self.config.min_requests}
        hws = sorted({hw for t in profiled for hw in self.static(t)})
        if len(profiled) < 2 or any(hw not in self.profiles for hw in hws):
            orders: dict[str, tuple[str, ...]] = {}
        else:
            times = {
                t: {hw: request_time_s(self.profiles[hw], s.prompt, s.answer, self.config.batch) for hw in hws}
                for t, s in profiled.items()
            }
            mean = {hw: statistics.geometric_mean(times[t][hw] for t in times) for hw in hws}
            orders = {}
            for t in profiled:
                static = self.static(t)
                order = tuple(sorted(static, key=lambda hw: (times[t][hw] / mean[hw], static.index(hw))))
                if order != static:
                    orders[t] = order
        changed = {t for t in set(orders) | set(self._orders) if orders.get(t) != self._orders.get(t)}
        self._orders = orders
        for t in changed:
            s, o = self.stats[t], orders.get(t, self.static(t))
            log.info(
                "routing: tag %r (prompt %.0f, answer %.0f tokens over %d requests) prefers %s",
                t,
                s.prompt,
                s.answer,
                s.requests,
                list(o),
            )

    def preference(self, tag: str) -> tuple[str, ...] | None:
        """The automatic order for ``tag``, or None to use the static one."""
        return self._orders.get(tag)

    def mapping(self) -> dict[str, list[str]]:
        """Every tag whose order differs from its static one."""
        return {t: list(o) for t, o in self._orders.items()}

    def state_dict(self) -> dict[str, dict[str, int]]:
        return {t: vars(s).copy() for t, s in self.stats.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, int]]) -> None:
        with self._lock:
            self.stats = {t: TaskShapeStats(**dict(s)) for t, s in state.items()}
            self._recompute()
