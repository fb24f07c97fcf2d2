"""Where a run's trace spans go: the OpenTelemetry export of ``traces.otlp_endpoint`` (the ``otel`` extra,
imported only when one is set)."""

from __future__ import annotations

from typing import Any


def span_export(traces: Any, *, seed: int, service: str) -> Any:
    """The OpenTelemetry export of a run's traces (``traces.otlp_endpoint`` of the ``traces:`` section
    ``traces``), or None when unset; ``service`` names the run where ``traces.otlp_service_name`` does not."""
    if traces.otlp_endpoint is None:
        return None
    from rollart.tracking.otel import SpanExport

    return SpanExport(
        traces.otlp_endpoint,
        seed=seed,
        service_name=traces.otlp_service_name or service,
        headers=traces.otlp_headers,
        timeout_s=traces.otlp_timeout_s,
    )
