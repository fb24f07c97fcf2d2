"""Trajectory traces as OpenTelemetry spans, sent to a collector over OTLP/HTTP (``traces.otlp_endpoint``).

:class:`SpanExport` receives the events :class:`~rollart.tracking.traces.TraceWriter` wrote to
``traces.jsonl`` (in the writer's thread, after each write), keeps each trajectory's life until its end
event (``trained``, ``dropped``, ``filtered``, ``evicted``, ``failed``) and turns it into spans through the
OpenTelemetry SDK: one root span ``trajectory`` per life (``created`` to its end), a child span per event
with a duration (``admission``, ``env_reset``, ``generate``, ``env_step``, ``reward``: from ``t - latency_s``
to ``t``) and a span event per instantaneous one. A ``BatchSpanProcessor`` sends them from its own thread.

Times are the recorded ``t`` values in nanoseconds (:func:`ns`); ids are derived from the run's seed and
the trajectory id (:func:`trace_id`), so a trajectory's trace id is known without the collector. A collector
that cannot be reached is logged once; spans are dropped while it is down (the JSONL file is the record).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from rollart.tracking.traces import ENDS, RUN

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
# events with a duration (``latency_s``, measured up to ``t``): child spans; the others are span events
TIMED = ("env_reset", "generate", "env_step", "reward")
# the exporter's own logger (its retries and failures): quieted inside SpanExport's exports, which log once
_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
# the batch processor's logger (a full queue drops spans): quieted while SpanExport makes spans, logged once
_PROCESSOR_LOGGER = "opentelemetry.sdk._shared_internal"
QUEUE_SPANS = 2**15
"""Spans queued for the collector at most (about 25 steps of the quickstart, every trajectory traced)."""
RETRY_S = 60.0
"""While the collector is down, how long spans are dropped before the next try."""


def ns(t: float) -> int:
    """A recorded time (Unix seconds) as the span's timestamp: nanoseconds, rounded."""
    return round(t * 1_000_000_000)


def _digest(*parts: object) -> bytes:
    return hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()


def trace_id(seed: int, traj_id: str) -> int:
    """The trace id of ``traj_id``'s spans in a run with ``seed`` (128 bits of SHA-256 of ``"SEED:TRAJ_ID"``):
    the same in every export of that trajectory; a round played again under the same id adds a root span
    to the same trace."""
    return int.from_bytes(_digest(seed, traj_id)[:16], "big") or 1


def _span_id(seed: int, traj_id: str, created: float, index: int) -> int:
    return int.from_bytes(_digest(seed, traj_id, repr(created), index)[:8], "big") or 1


def endpoint_url(endpoint: str) -> str:
    """The collector's traces URL: ``endpoint`` as given when it ends in ``/v1/traces``, else with it."""
    base = endpoint.rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


class _PlannedIds(IdGenerator):
    """The ids of the next span, set before it starts (spans are started in one thread at a time)."""

    def __init__(self) -> None:
        self.trace_id = 1
        self.span_id = 1

    def generate_trace_id(self) -> int:
        return self.trace_id

    def generate_span_id(self) -> int:
        return self.span_id


class _Quiet(logging.Filter):
    """Drops the OTLP exporter's log records emitted inside a guarded export (its retries, its failure):
    the guard logs the outage once; keeps the last message for that line."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()
        self.last = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(self.local, "on", False):
            self.last = record.getMessage()
            return False
        return True


class _Guarded(SpanExporter):
    """The OTLP exporter behind a guard: a failed export is logged once (and its recovery once); while the
    collector is down, spans are dropped for ``RETRY_S`` before the next try, so the queue never backs up;
    :meth:`abort` drops the rest at the end of a run whose collector is down."""

    def __init__(self, inner: SpanExporter, url: str):
        self.inner, self.url = inner, url
        self.down_since: float | None = None
        self.warned = False
        self.failed_exports = 0
        self.exported = 0  # spans the collector accepted
        self._aborted = False
        self._quiet = _Quiet()
        logging.getLogger(_EXPORTER_LOGGER).addFilter(self._quiet)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        now = time.monotonic()
        if self._aborted or (self.down_since is not None and now - self.down_since < RETRY_S):
            return SpanExportResult.FAILURE
        self._quiet.local.on = True
        try:
            result = self.inner.export(spans)
        except Exception as e:  # a collector must never fail the run
            self._quiet.last = repr(e)
            result = SpanExportResult.FAILURE
        finally:
            self._quiet.local.on = False
        if result is SpanExportResult.SUCCESS:
            if self.down_since is not None:
                log.info("traces: the OpenTelemetry collector at %s is reachable again", self.url)
            self.down_since = None
            self.exported += len(spans)
            return result
        self.failed_exports += 1
        self.down_since = now
        if not self.warned:
            self.warned = True
            log.warning(
                "traces: exporting spans to the OpenTelemetry collector at %s (traces.otlp_endpoint) failed (%s); "
                "the run goes on, spans are dropped while it is unreachable (tried again every %.0f s) and "
                "traces.jsonl stays complete",
                self.url,
                self._quiet.last or "no answer",
                RETRY_S,
            )
        return result

    def abort(self) -> None:
        """Drop what is left (the collector is down at the end of the run): retries in flight stop."""
        self._aborted = True
        self.inner.shutdown()

    def shutdown(self) -> None:
        logging.getLogger(_EXPORTER_LOGGER).removeFilter(self._quiet)
        if not self._aborted:
            self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _attributes(fields: Mapping[str, Any], prefix: str = "rollart.") -> dict[str, Any]:
    """An event's fields as span attributes ``rollart.FIELD``: a dict's keys as ``rollart.FIELD.KEY``,
    lists of one scalar type as they are, anything else (mixed lists, None) as JSON text or left out."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        name = prefix + str(key)
        if value is None:
            continue
        if isinstance(value, Mapping):
            out.update(_attributes(value, name + "."))
        elif isinstance(value, bool | int | float | str):
            out[name] = value
        elif isinstance(value, list | tuple) and value and len({type(v) for v in value}) == 1:
            first = value[0]
            out[name] = list(value) if isinstance(first, bool | int | float | str) else json.dumps(value, default=str)
        else:
            out[name] = json.dumps(value, default=str)
    return out


_SKIP = {"traj_id", "event", "t"}


class SpanExport:
    """Trajectory lives as spans to an OTLP/HTTP collector: :meth:`add` the events written (one thread),
    :meth:`close` at the end of the run (the lives still open are sent as ``open``, the rest flushed and
    the provider shut down; events added after it start a new provider)."""

    def __init__(
        self,
        endpoint: str,
        *,
        seed: int = 0,
        service_name: str = "rollart",
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
    ):
        self.url = endpoint_url(endpoint)
        self.seed = seed
        self.service_name = service_name
        self.headers = dict(headers or {})
        self.timeout_s = timeout_s
        self.lives_exported = 0
        self._open: dict[str, list[dict[str, Any]]] = {}
        self._provider: TracerProvider | None = None
        self._guard: _Guarded | None = None
        self._tracer: trace.Tracer | None = None
        self._ids = _PlannedIds()
        self._full = _Quiet()  # the processor's "queue full" lines while spans are made
        self.queue_full_warned = False

    def _start(self) -> trace.Tracer:
        if self._tracer is None:  # first use, or events after close
            self._guard = _Guarded(
                OTLPSpanExporter(endpoint=self.url, headers=self.headers, timeout=self.timeout_s), self.url
            )
            self._provider = TracerProvider(
                resource=Resource.create({"service.name": self.service_name}),
                id_generator=self._ids,
                sampler=ALWAYS_ON,
            )
            self._provider.add_span_processor(
                BatchSpanProcessor(self._guard, max_queue_size=QUEUE_SPANS, max_export_batch_size=min(512, QUEUE_SPANS))
            )
            self._tracer = self._provider.get_tracer("rollart.tracking.otel")
        return self._tracer

    def add(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Events as ``traces.jsonl`` holds them, in order: each life is exported when its end arrives."""
        with self._making_spans():
            for e in events:
                self._add(e)

    def _add(self, e: Mapping[str, Any]) -> None:
        tid = e.get("traj_id", RUN)
        if tid == RUN:
            return
        life = self._open.get(tid)
        if life is not None and e["event"] == "created" and life:
            self._export(life)  # the id is played again: the earlier life ended without an end event
            life = None
        if life is None:
            life = self._open[tid] = []
        life.append(dict(e))
        if e["event"] in ENDS:
            self._export(self._open.pop(tid))

    @contextlib.contextmanager
    def _making_spans(self) -> Iterator[None]:
        """The processor's "queue full" lines while spans are made: one warning for the run."""
        self._full.last = ""
        self._full.local.on = True
        processor = logging.getLogger(_PROCESSOR_LOGGER)
        processor.addFilter(self._full)
        try:
            yield
        finally:
            self._full.local.on = False
            processor.removeFilter(self._full)
        if self._full.last and not self.queue_full_warned:
            self.queue_full_warned = True
            log.warning(
                "traces: the OpenTelemetry collector at %s does not keep up (%d spans queued): spans are dropped "
                "(%s); traces.jsonl stays complete",
                self.url,
                QUEUE_SPANS,
                self._full.last,
            )

    def _export(self, life: list[dict[str, Any]]) -> None:
        tracer = self._start()
        first, last = life[0], life[-1]
        tid = str(first["traj_id"])
        end = last if last["event"] in ENDS else None
        created = float(first["t"])
        outcome = ENDS[end["event"]] if end is not None else "open"
        attrs: dict[str, Any] = {"rollart.traj_id": tid, "rollart.outcome": outcome}
        if first["event"] == "created":
            attrs |= _attributes({k: v for k, v in first.items() if k not in _SKIP})
        for e in life:
            if e["event"] == "cost":
                attrs |= _attributes({k: v for k, v in e.items() if k not in _SKIP}, "rollart.cost.")
            elif e["event"] == "admitted":
                attrs |= _attributes({"start_version": e.get("start_version"), "env_seed": e.get("seed")})
        if end is not None:
            attrs |= _attributes({k: v for k, v in end.items() if k not in _SKIP and k != "error"})
            if end.get("error") is not None:
                attrs["rollart.error"] = str(end["error"])
        self._ids.trace_id = trace_id(self.seed, tid)
        self._ids.span_id = _span_id(self.seed, tid, created, 0)
        root = tracer.start_span(
            "trajectory", context=Context(), kind=SpanKind.INTERNAL, attributes=attrs, start_time=ns(created)
        )
        parent = trace.set_span_in_context(root, Context())
        for i, e in enumerate(life, start=1):
            fields = {k: v for k, v in e.items() if k not in _SKIP}
            t = float(e["t"])
            if e["event"] in TIMED and isinstance(e.get("latency_s"), int | float):
                self._ids.span_id = _span_id(self.seed, tid, created, i)
                child = tracer.start_span(
                    e["event"], context=parent, attributes=_attributes(fields), start_time=ns(t - e["latency_s"])
                )
                _status(child, e)
                child.end(end_time=ns(t))
            elif e["event"] == "admitted" and isinstance(e.get("wait_s"), int | float) and first["event"] == "created":
                self._ids.span_id = _span_id(self.seed, tid, created, i)
                child = tracer.start_span(
                    "admission", context=parent, attributes=_attributes(fields), start_time=ns(created)
                )
                child.end(end_time=ns(t))
            else:
                root.add_event(e["event"], attributes=_attributes(fields), timestamp=ns(t))
        if outcome == "failed":
            root.set_status(Status(StatusCode.ERROR, str((end or {}).get("error") or "failed")))
        root.end(end_time=ns(float(last["t"])))
        self.lives_exported += 1

    @property
    def failed_exports(self) -> int:
        """Exports the collector did not accept (each of one batch of spans)."""
        return self._guard.failed_exports if self._guard is not None else 0

    @property
    def spans_exported(self) -> int:
        return self._guard.exported if self._guard is not None else 0

    def close(self) -> None:
        """Send the lives still open (as ``open``), flush and shut the provider down: quickly when the
        collector is down (what is left is dropped), else once the collector took every span."""
        with self._making_spans():
            for life in list(self._open.values()):
                self._export(life)
        self._open.clear()
        if self._provider is None or self._guard is None:
            return
        if self._guard.down_since is None:
            self._provider.force_flush()
        if self._guard.down_since is not None:
            self._guard.abort()
        self._provider.shutdown()
        self._provider = self._tracer = None


def _status(span: Span, event: Mapping[str, Any]) -> None:
    if event.get("error") is not None or event.get("status") == "failed":
        span.set_status(Status(StatusCode.ERROR, str(event.get("error") or "failed")))
