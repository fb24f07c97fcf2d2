"""Trajectory traces exported as OpenTelemetry spans (``traces.otlp_endpoint``): a real run sends every traced
trajectory to an OTLP/HTTP collector (a receiver here that decodes the wire format) as one root span with
its events as child spans and span events, at the times of ``traces.jsonl``; a collector that is down
costs one warning and leaves the file complete; the config names the missing extra."""

import logging
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from test_pipeline import small_config

from rollart.tracking import otel
from rollart.tracking.otel import SpanExport, ns, trace_id
from rollart.tracking.traces import TraceWriter, lives, read_traces

pytestmark = pytest.mark.timeout(600)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def _attrs(kvs):
    return {kv.key: _value(kv.value) for kv in kvs}


class Collector:
    """An OTLP/HTTP receiver on 127.0.0.1: POST /v1/traces with a protobuf ExportTraceServiceRequest."""

    def __init__(self):
        self.spans: list[dict] = []
        self.requests: list[dict] = []
        self.gate = threading.Event()  # answers once set (a collector that does not keep up until then)
        self.gate.set()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                collector.gate.wait(60)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/v1/traces" or self.headers["Content-Type"] != "application/x-protobuf":
                    self.send_error(404)
                    return
                req = ExportTraceServiceRequest.FromString(body)
                collector.requests.append(dict(self.headers))
                for rs in req.resource_spans:
                    resource = _attrs(rs.resource.attributes)
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            collector.spans.append(
                                {
                                    "name": s.name,
                                    "trace_id": int.from_bytes(s.trace_id, "big"),
                                    "span_id": int.from_bytes(s.span_id, "big"),
                                    "parent": int.from_bytes(s.parent_span_id, "big") if s.parent_span_id else None,
                                    "start": s.start_time_unix_nano,
                                    "end": s.end_time_unix_nano,
                                    "attrs": _attrs(s.attributes),
                                    "events": [(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events],
                                    "status": s.status.code,
                                    "resource": resource,
                                }
                            )
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def otel_run(ray_local, tmp_path_factory):
    """A small run (alpha 1, 2 steps) with traces exported to a collector: its folder and the collector."""
    from rollart.pipelines.agentic import AgenticPipeline

    collector = Collector()
    tmp = tmp_path_factory.mktemp("otel")
    traces = {"enabled": True, "otlp_endpoint": collector.url, "otlp_headers": {"x-api-key": "k1"}}
    cfg = small_config(tmp, steps=2, checkpoint_every=0, traces=traces, seed=5)
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        pipe.run()
    finally:
        pipe.shutdown()
        collector.close()
    return tmp / "run", collector


def test_a_run_exports_every_traced_life_as_a_trace_with_the_files_times(otel_run):
    run, collector = otel_run
    all_lives = lives(read_traces(run))
    ended = [life for life in all_lives if life.end is not None]
    trained = [life for life in all_lives if life.outcome == "trained"]
    assert len(trained) == 2 * 2 * 4
    roots = [s for s in collector.spans if s["name"] == "trajectory"]
    # one root span per life, every life of the file (those open at the end as "open"), each in its own trace
    assert sorted(r["attrs"]["rollart.traj_id"] for r in roots) == sorted(life.traj_id for life in all_lives)
    assert all(r["parent"] is None and r["resource"]["service.name"] == "t" for r in roots)
    assert {r["trace_id"] for r in roots} == {trace_id(5, life.traj_id) for life in all_lives}
    assert all(h.get("x-api-key") == "k1" for h in collector.requests)
    by_id = {r["attrs"]["rollart.traj_id"]: r for r in roots}
    children: dict[int, list[dict]] = {}
    for s in collector.spans:
        if s["parent"] is not None:
            children.setdefault(s["parent"], []).append(s)
    for life in ended:
        root = by_id[life.traj_id]
        first, end = life.events[0], life.end
        assert root["attrs"]["rollart.outcome"] == life.outcome and root["attrs"]["rollart.tag"] == "reverse-3"
        assert root["start"] == ns(first["t"]) and root["end"] == ns(end["t"])
        mine = sorted(children[root["span_id"]], key=lambda s: (s["end"], s["name"]))
        assert all(s["trace_id"] == root["trace_id"] for s in mine)
        timed = [e for e in life.events if e["event"] in ("env_reset", "generate", "env_step", "reward")]
        # a child per event with a duration (and the admission wait), ending at the event's recorded time
        assert sorted((s["name"], s["end"]) for s in mine) == sorted(
            [(e["event"], ns(e["t"])) for e in timed] + [("admission", ns(life.events[1]["t"]))]
        )
        gens = [s for s in mine if s["name"] == "generate"]
        recorded = [e for e in life.events if e["event"] == "generate"]
        assert len(gens) == len(recorded) > 0
        for span, e in zip(sorted(gens, key=lambda s: s["end"]), sorted(recorded, key=lambda e: e["t"]), strict=True):
            assert span["attrs"]["rollart.rank"] == e["rank"] == 0 and span["attrs"]["rollart.hardware"] == "CPU"
            assert span["attrs"]["rollart.node_ip"] == e["node_ip"]
            assert span["attrs"]["rollart.response_tokens"] == e["response_tokens"]
            assert span["start"] == ns(e["t"] - e["latency_s"]) and span["end"] == ns(e["t"])
        # the instantaneous events as span events at their times
        instant = [
            (e["event"], ns(e["t"]))
            for e in life.events
            if e["event"] not in ("admitted", *[t["event"] for t in timed])
        ]
        assert sorted((n, t) for n, t, _ in root["events"]) == sorted(instant)
        if life.outcome == "trained":
            assert (
                root["attrs"]["rollart.step"] == end["step"] and root["attrs"]["rollart.staleness"] == end["staleness"]
            )
            assert root["attrs"]["rollart.reward"] == end["reward"]
            assert root["attrs"]["rollart.cost.worker_s.rollout"] == life.cost["worker_s"]["rollout"]
            assert ("trained", ns(end["t"])) in [(n, t) for n, t, _ in root["events"]]
        else:  # dropped: why
            assert root["attrs"].get("rollart.reason") == end.get("reason")
    # nothing but the file's lives: a root per life, a child per timed event and per admission wait
    timed_events = [e for e in read_traces(run) if e["event"] in ("env_reset", "generate", "env_step", "reward")]
    admissions = [life for life in all_lives if len(life.events) > 1 and life.events[1]["event"] == "admitted"]
    assert len(collector.spans) == len(all_lives) + len(timed_events) + len(admissions)


def test_a_collector_that_is_down_costs_one_warning_and_the_file_stays_complete(otel_run, tmp_path, caplog):
    run, _ = otel_run
    events = [e for e in read_traces(run) if e["traj_id"]]
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spans = SpanExport(f"http://127.0.0.1:{port}", seed=5, timeout_s=1)
    writer = TraceWriter(tmp_path, seed=5, spans=spans)
    with caplog.at_level(logging.WARNING):
        half = len(events) // 2
        for part in (events[:half], events[half:]):  # two steps' flushes, then the end of the run
            for e in part:
                writer.emit(e["traj_id"], e["event"], **{k: v for k, v in e.items() if k not in ("traj_id", "event")})
            writer.flush()
        writer.close()
    written = [e for e in read_traces(tmp_path) if e["traj_id"]]
    assert written == events  # every event in the file, as recorded
    assert spans.lives_exported == len(lives(events)) and spans.failed_exports >= 1 and spans.spans_exported == 0
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "traces.otlp_endpoint" in warnings[0].getMessage()
    assert f"127.0.0.1:{port}" in warnings[0].getMessage()


def test_a_collector_that_does_not_keep_up_costs_one_warning(otel_run, monkeypatch, caplog):
    run, _ = otel_run
    events = list(read_traces(run))
    monkeypatch.setattr(otel, "QUEUE_SPANS", 4)  # 4 spans queued at most: the first batch blocks the rest
    collector = Collector()
    collector.gate.clear()
    spans = SpanExport(collector.url, seed=5)
    try:
        with caplog.at_level(logging.WARNING):
            spans.add(events)  # far more than 4 spans while the collector holds its first request
            collector.gate.set()
            spans.close()
    finally:
        collector.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "does not keep up" in warnings[0], warnings
    assert spans.queue_full_warned and 0 < len(collector.spans) < 5 * spans.lives_exported
    assert spans.lives_exported == len(lives(events)) and spans.failed_exports == 0


def test_an_otlp_endpoint_without_the_otel_extra_is_refused_naming_the_field_and_the_fix(tmp_path, monkeypatch):
    traces = {"enabled": True, "otlp_endpoint": "http://127.0.0.1:4318"}
    assert small_config(tmp_path, traces=traces).traces.otlp_endpoint == "http://127.0.0.1:4318"
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)  # not installed
    with pytest.raises(ValueError, match=r"traces\.otlp_endpoint.*pip install 'rollart\[otel\]'"):
        small_config(tmp_path, traces=traces)
    with pytest.raises(ValueError, match=r"traces\.enabled: true"):
        small_config(tmp_path, traces={"otlp_endpoint": "http://127.0.0.1:4318"})
    with pytest.raises(ValueError, match=r"traces\.otlp_endpoint.*not an http"):
        small_config(tmp_path, traces={"enabled": True, "otlp_endpoint": "127.0.0.1:4318"})
