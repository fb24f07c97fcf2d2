"""Trajectory traces: ``RUN_DIR/traces.jsonl``, every traced trajectory's events with their times.

One JSON object per line: ``traj_id``, ``event``, ``t`` (Unix time, seconds) and the event's fields (the
schema: ``docs/traces.md``). The rollout emits events into a :class:`TraceWriter`, which only keeps them
in memory; once per step, while the trainer computes and the driver would only wait for it, the pipeline
calls :meth:`TraceWriter.flush`, which encodes them and appends them to the file. Nothing on the rollout's
path encodes or touches the file. ``sample`` picks the traced trajectories by a hash of the run's seed and
the trajectory id (:func:`sampled`: the same ids in every run with that seed); ``max_mb`` caps the file,
past which tracing stops with one log line (the ledger's counts do not depend on traces). With a span
export (``traces.otlp_endpoint``: :class:`rollart.tracking.otel.SpanExport`) a writing thread also hands
the events written to it, which sends them to an OpenTelemetry collector as spans.

The reader side (:func:`read_traces`, :func:`lives`, :func:`timeline`) serves ``rollart trace``.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

log = logging.getLogger(__name__)

TRACES = "traces.jsonl"
# one line per event; numpy numbers written as numbers and keys that are not strings (a dict keyed by int) as
# strings, as json does; anything else orjson does not know is written as its str()
ENCODE_OPTIONS = orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
RUN = ""
"""The ``traj_id`` of the run's own events (``trace_started``)."""
ENDS = {"trained": "trained", "failed": "failed", "dropped": "dropped", "filtered": "dropped", "evicted": "dropped"}
"""Events that end a trajectory's life, and the outcome each counts as (``rollart trace --status``)."""


class SpanSink(Protocol):
    """Where the written events also go (:class:`rollart.tracking.otel.SpanExport`): ``add`` is called in the
    writing thread after each write, ``close`` at the end of the run."""

    def add(self, events: Iterable[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def sampled(traj_id: str, seed: int, fraction: float) -> bool:
    """Whether ``traj_id`` is traced at sampling ``fraction`` under the run's ``seed``: the trajectory's
    hash (CRC-32 of ``"seed:traj_id"``) below ``fraction`` of its range. Deterministic across runs."""
    if fraction >= 1.0:
        return True
    if fraction <= 0.0:
        return False
    return zlib.crc32(f"{seed}:{traj_id}".encode()) < fraction * 2**32


class TraceWriter:
    """Buffers trace events and appends them to ``run_dir/traces.jsonl`` on :meth:`flush`; a fresh (not
    resumed) run starts the file anew. ``emit`` and ``flush`` are called from one thread (the rollout and
    the step loop share one event loop). ``spans``: also export the written events (as OpenTelemetry spans,
    in a thread of its own); a failure there is logged once and never stops the file."""

    def __init__(
        self,
        run_dir: Path,
        *,
        sample: float = 1.0,
        seed: int = 0,
        max_mb: float = 256.0,
        resume: bool = False,
        spans: SpanSink | None = None,
    ):
        self.path = Path(run_dir) / TRACES
        self.sample, self.seed = sample, seed
        self.max_bytes = int(max_mb * 2**20)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume and self.path.exists():
            self.path.unlink()
        self.written = self.path.stat().st_size if self.path.exists() else 0  # bytes in the file
        self.capped = False
        self.events = 0  # events written to the file
        # the events emitted since the last flush, as emitted, flat: traj_id, event, t, fields, traj_id, ...
        # (a tuple per event would be a container the garbage collector tracks: ~2,400 more per quickstart
        # step, each batch of 700 one more collection); encoding waits for the flush, which the pipeline
        # calls while the driver has nothing else to do
        self._buffer: list[Any] = []
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollart-traces")
        self._pending: Future[None] | None = None
        self.spans = spans
        self.emit(RUN, "trace_started", sample=sample, seed=seed, max_mb=max_mb, resumed=resume)

    def wants(self, traj_id: str) -> bool:
        return not self.capped and sampled(traj_id, self.seed, self.sample)

    def emit(self, traj_id: str, event: str, /, t: float | None = None, **fields: Any) -> None:
        """One event of ``traj_id`` at ``t`` (default: now); dropped once the file reached its cap. The
        fields are encoded at the next :meth:`flush`: pass values (numbers, strings, fresh lists and dicts),
        not objects that change after the call."""
        if not self.capped:
            buf = self._buffer
            buf.append(traj_id)
            buf.append(event)
            buf.append(time.time() if t is None else t)
            buf.append(fields)

    def trained(self, groups: Iterable[Iterable[Any]], *, step: int, version: int) -> None:
        """The trajectories of one batch, trained at ``step`` (counted from 1, as ``metrics.jsonl``) by the
        policy ``version``; staleness as the step record counts it (``version`` minus the group's start)."""
        if self.capped:
            return
        now = time.time()
        for group in groups:
            members = list(group)
            start = min(t.start_version for t in members)
            for traj in members:
                if self.wants(traj.traj_id):
                    self.emit(
                        traj.traj_id,
                        "trained",
                        t=now,
                        step=step,
                        version=version,
                        staleness=version - start,
                        reward=traj.reward,
                    )

    def flush(self, wait: bool = False) -> None:
        """Encode the events emitted since the last flush and append them to the file, up to the cap
        (``max_mb``); the pipeline calls it once per step, while the trainer computes. With a span export
        the records also go to the writing thread, which makes the spans (``wait``: return once it has).

        The rollout only keeps its events; on a busy driver, where the rollout's loop is the step's
        critical path, encoding there took its time from the step, here it overlaps the train step."""
        if self._buffer:
            events, self._buffer = self._buffer, []
            data, count, records = self._encode(events)
            if data:
                with self.path.open("ab") as f:
                    f.write(data)
                self.written += len(data)
                self.events += count
            if records:
                self._pending = self._thread.submit(self._export, records)
        if wait and self._pending is not None:
            self._pending.result()

    def _encode(self, events: list[Any]) -> tuple[bytearray, int, list[dict[str, Any]]]:
        """The lines of the buffered events (``traj_id, event, t, fields`` each, flat) up to the cap (past
        it: none, and tracing stops), how many, and their records when spans are exported.

        Each line is appended to one buffer as soon as it is encoded: keeping thousands of small encoded
        lines alive until a join cost four times the encoding (~4 µs a line against ~1 µs)."""
        data = bytearray()
        count = 0
        records: list[dict[str, Any]] = []
        room = self.max_bytes - self.written
        for traj_id, event, t, fields in zip(events[0::4], events[1::4], events[2::4], events[3::4], strict=True):
            record = {"traj_id": traj_id, "event": event, "t": t, **fields}
            end = len(data)
            data += orjson.dumps(record, default=str, option=ENCODE_OPTIONS)
            if len(data) > room:
                del data[end:]
                self.capped = True
                log.warning(
                    "traces: %s reached traces.max_mb=%.0f; no more trajectories are traced in this run "
                    "(the ledger's counts are unaffected)",
                    self.path,
                    self.max_bytes / 2**20,
                )
                break
            count += 1
            if self.spans is not None:
                records.append(record)
        return data, count, records

    def _export(self, events: list[dict[str, Any]]) -> None:
        if self.spans is None or not events:
            return
        try:
            self.spans.add(events)
        except Exception:  # the file is the record: a span export that breaks is turned off, once
            log.warning("traces: exporting spans failed; no more spans are exported in this run", exc_info=True)
            self.spans = None

    def close(self) -> None:
        """Write what is buffered and wait for it (the end of the run; tracing may go on after it, e.g.
        when the steps resume after a trainer restore); the span export sends what it holds."""
        self.flush(wait=True)
        if self.spans is not None:
            self._thread.submit(self._close_spans).result()

    def _close_spans(self) -> None:
        try:
            if self.spans is not None:
                self.spans.close()
        except Exception:
            log.warning("traces: closing the span export failed", exc_info=True)


# ---------------------------------------------------------------------------------------------- reading
def read_traces(path: Path) -> Iterator[dict[str, Any]]:
    """The events of a traces file (a run folder or the file), in the order they were written; a last
    line cut short (a run killed while writing) is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / TRACES
    with path.open() as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


@dataclass
class Life:
    """One trajectory's life: its events from ``created`` to its end (a trajectory id played again, e.g.
    a failed round retried at the same version, has one life per ``created``)."""

    traj_id: str
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tag(self) -> str:
        return str(self.events[0].get("tag", "")) if self.events else ""

    @property
    def end(self) -> dict[str, Any] | None:
        last = self.events[-1] if self.events else None
        return last if last is not None and last["event"] in ENDS else None

    @property
    def outcome(self) -> str:
        """``trained``, ``failed``, ``dropped`` (also filtered and evicted), or ``open`` (no end recorded:
        running or buffered when the run stopped, or the file was capped)."""
        end = self.end
        return ENDS[end["event"]] if end is not None else "open"

    @property
    def duration_s(self) -> float:
        return float(self.events[-1]["t"] - self.events[0]["t"]) if self.events else 0.0

    @property
    def cost(self) -> dict[str, Any] | None:
        """Its ``cost`` event (what its episode was charged), or None (still running, or not recorded)."""
        return next((e for e in reversed(self.events) if e["event"] == "cost"), None)


def cost_table(chosen: Iterable[Life]) -> list[dict[str, Any]]:
    """The lives' cost summed per tag and outcome: trajectories, ``worker_s`` and ``device_s`` (all
    pools), ``env_s``, ``reward_s``; a life without a ``cost`` event counts in ``uncosted``."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for life in chosen:
        key = (life.tag, life.outcome)
        row = rows.setdefault(
            key,
            {"tag": key[0], "outcome": key[1], "trajectories": 0, "uncosted": 0}
            | dict.fromkeys(("worker_s", "device_s", "env_s", "reward_s"), 0.0),
        )
        row["trajectories"] += 1
        c = life.cost
        if c is None:
            row["uncosted"] += 1
            continue
        row["worker_s"] += sum(c.get("worker_s", {}).values())
        row["device_s"] += sum(c.get("device_s", {}).values())
        row["env_s"] += c.get("env_s", 0.0)
        row["reward_s"] += c.get("reward_s", 0.0)
    return [rows[k] for k in sorted(rows)]


def lives(events: Iterable[dict[str, Any]]) -> list[Life]:
    """Every trajectory's lives, in the order they were created."""
    out: list[Life] = []
    current: dict[str, Life] = {}
    for e in events:
        tid = e.get("traj_id", RUN)
        if tid == RUN:
            continue
        life = current.get(tid)
        if life is None or (e["event"] == "created" and life.events):
            life = current[tid] = Life(tid)
            out.append(life)
        life.events.append(e)
    return out


_SKIP = {"traj_id", "event", "t"}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value) if isinstance(value, list | dict) else str(value)


def timeline(life: Life) -> str:
    """A trajectory's life as text: one line per event, its time since ``created`` and its fields."""
    t0 = life.events[0]["t"] if life.events else 0.0
    rows = [f"{life.traj_id}  ({life.tag}, {life.outcome}, {life.duration_s:.3f}s)"]
    for e in life.events:
        fields = "  ".join(f"{k}={_fmt(v)}" for k, v in e.items() if k not in _SKIP and v is not None)
        since = f"+{e['t'] - t0:.3f}s"
        rows.append(f"  {since:>10}  {e['event']:<10} {fields}".rstrip())
    return "\n".join(rows)
