"""The tracked ratios of ``rollart bench history`` as asv benchmarks: one class per tracked bench run
(``<suite>_<bench>``, defined in :data:`rollart.benchmarks.history.TRACKED`), whose ``setup_cache`` runs
the bench once and whose ``track_<value>`` methods return the values asv records. Each class spells out
its own ``setup_cache``: asv keys that cache by the function's source line."""

from __future__ import annotations

from rollart.benchmarks.history import Tracked, by_name, measure


class _Run:
    processes = 1  # the bench ran once, in setup_cache: every value is read from that run
    unit = "ratio"
    run: Tracked


class ci_env_async(_Run):
    run = by_name("ci_env_async")
    timeout = run.timeout_s

    def setup_cache(self) -> dict[str, float]:
        return measure(self.run)

    setup_cache.timeout = run.timeout_s  # type: ignore[attr-defined]

    def track_speedup(self, values: dict[str, float]) -> float:
        return values["speedup"]

    def track_fraction_of_ideal(self, values: dict[str, float]) -> float:
        return values["fraction_of_ideal"]


class ci_queue_scheduling(_Run):
    run = by_name("ci_queue_scheduling")
    timeout = run.timeout_s

    def setup_cache(self) -> dict[str, float]:
        return measure(self.run)

    setup_cache.timeout = run.timeout_s  # type: ignore[attr-defined]

    def track_speedup(self, values: dict[str, float]) -> float:
        return values["speedup"]

    def track_fraction_of_model(self, values: dict[str, float]) -> float:
        return values["fraction_of_model"]


class full_env_async(_Run):
    run = by_name("full_env_async")
    timeout = run.timeout_s

    def setup_cache(self) -> dict[str, float]:
        return measure(self.run)

    setup_cache.timeout = run.timeout_s  # type: ignore[attr-defined]

    def track_speedup(self, values: dict[str, float]) -> float:
        return values["speedup"]

    def track_fraction_of_ideal(self, values: dict[str, float]) -> float:
        return values["fraction_of_ideal"]


class full_redundant_env(_Run):
    run = by_name("full_redundant_env")
    timeout = run.timeout_s

    def setup_cache(self) -> dict[str, float]:
        return measure(self.run)

    setup_cache.timeout = run.timeout_s  # type: ignore[attr-defined]

    def track_speedup(self, values: dict[str, float]) -> float:
        return values["speedup"]

    def track_fraction_of_model(self, values: dict[str, float]) -> float:
        return values["fraction_of_model"]


class full_queue_scheduling(_Run):
    run = by_name("full_queue_scheduling")
    timeout = run.timeout_s

    def setup_cache(self) -> dict[str, float]:
        return measure(self.run)

    setup_cache.timeout = run.timeout_s  # type: ignore[attr-defined]

    def track_speedup(self, values: dict[str, float]) -> float:
        return values["speedup"]

    def track_fraction_of_model(self, values: dict[str, float]) -> float:
        return values["fraction_of_model"]


class full_prompt_replication(_Run):
    run = by_name("full_prompt_replication")
    timeout = run.timeout_s

    def setup_cache(self) -> dict[str, float]:
        return measure(self.run)

    setup_cache.timeout = run.timeout_s  # type: ignore[attr-defined]

    def track_speedup(self, values: dict[str, float]) -> float:
        return values["speedup"]

    def track_fraction_of_model(self, values: dict[str, float]) -> float:
        return values["fraction_of_model"]


class full_async_train(_Run):
    run = by_name("full_async_train")
    timeout = run.timeout_s

    def setup_cache(self) -> dict[str, float]:
        return measure(self.run)

    setup_cache.timeout = run.timeout_s  # type: ignore[attr-defined]

    def track_alpha1_step_vs_sync(self, values: dict[str, float]) -> float:
        return values["alpha1_step_vs_sync"]

    def track_alpha2_step_vs_sync(self, values: dict[str, float]) -> float:
        return values["alpha2_step_vs_sync"]

    def track_alpha1_over_bound(self, values: dict[str, float]) -> float:
        return values["alpha1_over_bound"]


class full_throughput(_Run):
    run = by_name("full_throughput")
    timeout = run.timeout_s

    def setup_cache(self) -> dict[str, float]:
        return measure(self.run)

    setup_cache.timeout = run.timeout_s  # type: ignore[attr-defined]

    def track_sync_vs_trl(self, values: dict[str, float]) -> float:
        return values["sync_vs_trl"]

    def track_alpha1_vs_trl(self, values: dict[str, float]) -> float:
        return values["alpha1_vs_trl"]


class full_startup(_Run):
    run = by_name("full_startup")
    timeout = run.timeout_s

    def setup_cache(self) -> dict[str, float]:
        return measure(self.run)

    setup_cache.timeout = run.timeout_s  # type: ignore[attr-defined]

    def track_cpu_vs_bare_ray(self, values: dict[str, float]) -> float:
        return values["cpu_vs_bare_ray"]

    def track_first_step_vs_bare_ray(self, values: dict[str, float]) -> float:
        return values["first_step_vs_bare_ray"]
