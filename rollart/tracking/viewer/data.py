"""What ``rollart view`` shows, read from a run folder: the step records (``metrics.jsonl``), the
trajectory traces (``traces.jsonl``), the elastic pool's events (``elastic.jsonl``) and the ledger.

:class:`RunFolder` re-reads a file only when it changed (its size or modification time), and reads a
growing traces file from where it stopped, so a page polling a live run costs the new lines only. Every
method returns plain JSON-ready values (the viewer's ``/api/...`` answers).
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart.tracking.traces import ENDS, RUN, TRACES, Life
from rollart.tracking.viewer.tokens import TOKENS_NOTE, BatchTokens

METRICS = "metrics.jsonl"
ELASTIC = "elastic.jsonl"
LEDGER = "ledger.json"
SPANS_KEPT = 5_000
"""The newest generate calls the worker timeline returns (older ones are counted, not sent)."""
PER_TOKEN_FIELDS = ("tokens", "token_ids", "logprobs", "loss_mask", "observation", "tool_calls", "text")
"""Fields of a trace event the trajectory page shows as per-token or content data when present (the
traces of this version record token counts, not the tokens: see ``per_token_note``)."""
PER_TOKEN_NOTE = (
    f"No tokens for this trajectory: {TOKENS_NOTE} (the run's batches/ folder). traces.jsonl records each "
    "generate call's token counts and the policy versions of its tokens, each env step its latency, reward "
    "and errors; the env's observations and tool calls are not recorded in this version."
)


@dataclass
class _Tail:
    """A JSON-lines file read incrementally: the byte offset of the first line not read yet."""

    offset: int = 0
    identity: tuple[int, int] = (0, 0)  # (inode, device): a file replaced (a new run) is read anew
    rows: list[dict[str, Any]] = field(default_factory=list)

    def read_new(self, path: Path) -> tuple[list[dict[str, Any]], bool]:
        """The complete lines added since the last call, and whether the file was started anew (replaced,
        or shorter than what was read: everything read before is void)."""
        try:
            st = path.stat()
        except FileNotFoundError:
            reset = self.offset > 0
            self.offset, self.rows = 0, []
            return [], reset
        reset = False
        if (st.st_ino, st.st_dev) != self.identity or st.st_size < self.offset:
            reset = self.offset > 0 or bool(self.rows)
            self.offset, self.rows, self.identity = 0, [], (st.st_ino, st.st_dev)
        if st.st_size == self.offset:
            return [], reset
        with path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read(st.st_size - self.offset)
        end = chunk.rfind(b"\n")
        if end < 0:  # a line being written: read it once it is whole
            return [], reset
        self.offset += end + 1
        new: list[dict[str, Any]] = []
        for line in chunk[: end + 1].splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a killed writer
                continue
            if isinstance(row, dict):
                new.append(row)
        self.rows.extend(new)
        return new, reset


def _num(x: Any) -> float | None:
    """A finite number, else None (JSON has no NaN)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


class RunFolder:
    """A run folder as the viewer reads it; safe to call from several threads (one lock)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._metrics = _Tail()
        self._traces = _Tail()
        self._elastic = _Tail()
        self._lives: list[Life] = []
        self._current: dict[str, tuple[int, Life]] = {}  # trajectory id -> its newest life and its number
        self._run_events: list[dict[str, Any]] = []
        self._rows: dict[int, tuple[int, dict[str, Any]]] = {}  # life -> (its events then, its row)
        self._gens: list[dict[str, Any]] = []  # the timeline's generate calls and marks, from the events read
        self._marks: list[dict[str, Any]] = []
        self._trained_at: dict[int, float] = {}  # step -> its first trained event
        self._tags: set[str] = set()
        self._batches = BatchTokens(self.path)  # the tokens of trained trajectories (record_batches: true)

    # ------------------------------------------------------------------------------------------ reading
    def _refresh(self) -> None:
        self._metrics.read_new(self.path / METRICS)
        self._elastic.read_new(self.path / ELASTIC)
        new, reset = self._traces.read_new(self.path / TRACES)
        if reset:
            self._lives, self._current, self._run_events, self._rows = [], {}, [], {}
            self._gens, self._marks, self._trained_at, self._tags = [], [], {}, set()
            new = list(self._traces.rows)
        for e in new:  # as rollart.tracking.traces.lives, kept up to date line by line
            tid = e.get("traj_id", RUN)
            if tid == RUN:
                self._run_events.append(e)
                continue
            if not isinstance(tid, str) or not isinstance(e.get("event"), str) or _num(e.get("t")) is None:
                continue  # not a trace event (the schema: docs/traces.md)
            found = self._current.get(tid)
            if found is None or (e["event"] == "created" and found[1].events):
                found = self._current[tid] = (len(self._lives), Life(tid))
                self._lives.append(found[1])
            found[1].events.append(e)
            if len(found[1].events) == 1 and found[1].tag:
                self._tags.add(found[1].tag)
            self._on_timeline(*found, e)

    def _on_timeline(self, n: int, life: Life, e: dict[str, Any]) -> None:
        """What one event of life ``n`` puts on the workers' timeline (under the lock)."""
        kind, t = e.get("event"), _num(e.get("t"))
        if t is None:
            return
        if kind == "generate":
            lat = _num(e.get("latency_s")) or 0.0
            self._gens.append(
                {
                    "lane": _worker(e.get("rank"), e.get("hardware"), e.get("node_ip")),
                    "start": t - lat,
                    "end": t,
                    "kind": "generate",
                    "traj": n,
                    "label": f"{life.traj_id} turn {e.get('turn')}: {e.get('response_tokens')} tokens",
                }
            )
        elif kind == "migrate":
            self._marks.append(
                {
                    "lane": _worker(e.get("from_rank"), e.get("from_hardware"), e.get("from_node_ip")),
                    "t": t,
                    "kind": "fault",
                    "traj": n,
                    "label": f"worker died under {life.traj_id}: {e.get('error')}",
                }
            )
        elif kind == "trained" and isinstance(e.get("step"), int):
            self._trained_at[e["step"]] = min(self._trained_at.get(e["step"], t), t)
        elif kind in ("failed", "env_reset", "env_step") and e.get("error"):
            self._marks.append(
                {"lane": "env", "t": t, "kind": "fault", "traj": n, "label": f"{life.traj_id}: {e['error']}"}
            )

    def _records(self) -> list[dict[str, Any]]:
        """Every step's record in step order (a step done again after a trainer restore: its last)."""
        by_step: dict[int, dict[str, Any]] = {}
        for rec in self._metrics.rows:
            if isinstance(rec.get("step"), int):
                by_step[rec["step"]] = rec
        return [by_step[k] for k in sorted(by_step)]

    def stamp(self) -> list[int]:
        """Changes whenever a file the viewer reads changes (the page polls it to know when to re-read)."""
        out: list[int] = []
        for name in (METRICS, TRACES, ELASTIC, LEDGER):
            try:
                st = (self.path / name).stat()
                out += [st.st_size, st.st_mtime_ns]
            except FileNotFoundError:
                out += [0, 0]
        return out

    # ----------------------------------------------------------------------------------------- answers
    def summary(self) -> dict[str, Any]:
        """The run: its folder, the files present, step and trajectory counts, the ledger (at the end)."""
        with self._lock:
            self._refresh()
            records = self._records()
            ledger = None
            try:
                ledger = json.loads((self.path / LEDGER).read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            started = next((e for e in self._run_events if e.get("event") == "trace_started"), None)
            return {
                "run_dir": str(self.path.resolve()),
                "name": self.path.resolve().name,
                "files": {n: (self.path / n).is_file() for n in (METRICS, TRACES, ELASTIC, LEDGER)},
                "batch_record": self._batches.recorded(),
                "steps": len(records),
                "last_step": records[-1]["step"] if records else None,
                "trajectories": len(self._lives),
                "tags": sorted(self._tags),
                "ledger": ledger or (records[-1].get("ledger") if records else None),
                "traces": None if started is None else {k: started.get(k) for k in ("sample", "seed", "max_mb")},
                "per_token_note": PER_TOKEN_NOTE,
                "stamp": self.stamp(),
            }

    def curves(self) -> dict[str, Any]:
        """The per-step series of the curves: reward (mean and per tag), throughput, the step-time split,
        staleness (max and mean), pool sizes (the elastic pool's devices and workers, and the devices each
        pool held as the step's cost counts them)."""
        with self._lock:
            self._refresh()
            records = self._records()
        steps = [r["step"] for r in records]
        tags = sorted({t for r in records for t in (r.get("reward_by_tag") or {})})
        pools = sorted({p for r in records for p in ((r.get("cost") or {}).get("device_s") or {})})

        def series(get: Any) -> list[float | None]:
            out = []
            for r in records:
                try:
                    out.append(_num(get(r)))
                except (KeyError, TypeError, AttributeError):
                    out.append(None)
            return out

        def mean_staleness(r: dict[str, Any]) -> float | None:
            hist = {int(k): v for k, v in (r.get("staleness") or {}).items()}
            n = sum(hist.values())
            return sum(k * v for k, v in hist.items()) / n if n else None

        groups: dict[str, dict[str, list[float | None]]] = {
            "reward": {"mean": series(lambda r: r["reward_mean"])},
            "throughput": {"tokens/s": series(lambda r: r["tokens_per_s"])},
            "step_time": {
                part: series(lambda r, p=part: r["time"][p])
                for part in ("step_s", "rollout_wait_s", "train_s", "weight_sync_s")
            },
            "staleness": {"max": series(lambda r: r["max_staleness"]), "mean": series(mean_staleness)},
            "pools": {},
        }
        for tag in tags:
            groups["reward"][tag] = series(lambda r, t=tag: r["reward_by_tag"][t])
        if any("elastic" in r for r in records):
            groups["pools"]["elastic devices"] = series(lambda r: r["elastic"]["devices"])
            groups["pools"]["elastic workers"] = series(lambda r: r["elastic"]["workers"])
        for pool in pools:  # devices held in the step: device-seconds over the step's wall time
            groups["pools"][f"{pool} devices"] = series(
                lambda r, p=pool: r["cost"]["device_s"][p] / r["time"]["step_s"] if r["time"]["step_s"] else None
            )
        notes = {}
        if not groups["pools"]:
            notes["pools"] = (
                "no pool sizes recorded: the step records count accelerator pools (cost.device_s) and an "
                "elastic pool's workers; CPU pools are not counted"
            )
        return {"steps": steps, "series": groups, "notes": notes}

    def timeline(self) -> dict[str, Any]:
        """The workers' timeline: each rollout worker's generate calls (``[t - latency_s, t]``, the
        trajectory and turn), the trainer's steps (from the first ``trained`` event of a step, for the
        step's ``train_s``, then ``weight_sync_s``), and marks: migrations (a worker died under a call),
        failed trajectories, env errors, and the elastic pool's joins, leaves and losses."""
        with self._lock:
            self._refresh()
            records = {r["step"]: r for r in self._records()}
            gens, marks = list(self._gens), list(self._marks)
            trained_at = dict(self._trained_at)
            elastic = list(self._elastic.rows)
        dropped = max(0, len(gens) - SPANS_KEPT)
        if dropped:
            gens = sorted(gens, key=lambda x: x["end"])[-SPANS_KEPT:]
        spans = list(gens)
        for step, t in sorted(trained_at.items()):
            times = (records.get(step) or {}).get("time") or {}
            train_s, sync_s = _num(times.get("train_s")) or 0.0, _num(times.get("weight_sync_s")) or 0.0
            spans.append({"lane": "trainer", "start": t, "end": t + train_s, "kind": "train", "label": f"step {step}"})
            if sync_s:
                spans.append(
                    {
                        "lane": "trainer",
                        "start": t + train_s,
                        "end": t + train_s + sync_s,
                        "kind": "sync",
                        "label": f"step {step}: weight sync",
                    }
                )
        for row in elastic:
            kind, when = row.get("event"), _num(row.get("time"))
            if when is None or kind not in ("joined", "left", "lost", "draining", "node_joined", "node_left"):
                continue
            lane = _worker(row.get("rank"), row.get("hardware"), row.get("node_ip")) if "rank" in row else "pool"
            label = f"{kind}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("event", "time"))
            marks.append(
                {"lane": lane, "t": when, "kind": "join" if kind.endswith("joined") else "fault", "label": label}
            )
        lanes = sorted({s["lane"] for s in spans} | {m["lane"] for m in marks}, key=_lane_order)
        return {"lanes": lanes, "spans": spans, "marks": marks, "spans_not_shown": dropped}

    def trajectories(
        self,
        *,
        tag: str | None = None,
        status: str | None = None,
        reward_min: float | None = None,
        reward_max: float | None = None,
        staleness_min: int | None = None,
        staleness_max: int | None = None,
        offset: int = 0,
        limit: int = 200,
    ) -> dict[str, Any]:
        """The traced trajectories that pass the filters (a bound on reward or staleness leaves out the
        ones without that value), newest first: ``total`` matching, ``rows`` from ``offset``."""
        with self._lock:
            self._refresh()
            every = [self._row(n) for n in range(len(self._lives))]
        rows = []
        for row in reversed(every):
            if tag is not None and row["tag"] != tag:
                continue
            if status is not None and row["outcome"] != status:
                continue
            r, s = row["reward"], row["staleness"]
            if (reward_min is not None or reward_max is not None) and r is None:
                continue
            if reward_min is not None and r < reward_min or reward_max is not None and r > reward_max:
                continue
            if (staleness_min is not None or staleness_max is not None) and s is None:
                continue
            if staleness_min is not None and s < staleness_min or staleness_max is not None and s > staleness_max:
                continue
            rows.append(row)
        return {"total": len(rows), "rows": rows[offset : offset + limit]}

    def _row(self, n: int) -> dict[str, Any]:
        """The list row of life ``n``, made again only when the life got new events (under the lock)."""
        life = self._lives[n]
        cached = self._rows.get(n)
        if cached is None or cached[0] != len(life.events):
            cached = self._rows[n] = (len(life.events), _row(n, life))
        return cached[1]

    def trajectory(self, n: int) -> dict[str, Any] | None:
        """One trajectory's life (its number in the list: ``id`` of a row): the summary row, its turns
        (the generate calls, migrations and env step of each), its reward call, its events with their
        time since ``created``, the per-token or content fields its events hold (none in this version), and
        ``tokens``: a trained trajectory's row of the batch record (:class:`BatchTokens`), or None."""
        with self._lock:
            self._refresh()
            if not 0 <= n < len(self._lives):
                return None
            life = self._lives[n]
            events = list(life.events)
        t0 = _num(events[0].get("t")) or 0.0 if events else 0.0
        turns: dict[int, dict[str, Any]] = {}
        for e in events:
            if e.get("event") in ("generate", "migrate", "env_step") and isinstance(e.get("turn"), int):
                turn = turns.setdefault(e["turn"], {"turn": e["turn"], "calls": [], "migrations": [], "env_step": None})
                if e["event"] == "generate":
                    turn["calls"].append(e)
                elif e["event"] == "migrate":
                    turn["migrations"].append(e)
                else:
                    turn["env_step"] = e
        content = [
            {"event": e["event"], **{k: e[k] for k in PER_TOKEN_FIELDS if k in e}}
            for e in events
            if any(k in e for k in PER_TOKEN_FIELDS)
        ]
        row = _row(n, life)
        tokens = self._batches.tokens(life.traj_id, row["step"]) if row["outcome"] == "trained" else None
        return {
            **row,
            "turns": [turns[k] for k in sorted(turns)],
            "reward_call": next((e for e in events if e.get("event") == "reward"), None),
            "events": [{**e, "since_s": (_num(e.get("t")) or t0) - t0} for e in events],
            "content": content,
            "tokens": tokens,
            "per_token_note": None if content or tokens else PER_TOKEN_NOTE,
        }


def _worker(rank: Any, hardware: Any, node_ip: Any) -> str:
    return f"rollout {rank} ({hardware}, {node_ip})" if node_ip else f"rollout {rank} ({hardware})"


def _lane_order(lane: str) -> tuple[int, int, str]:
    if lane == "trainer":
        return (0, 0, lane)
    if lane.startswith("rollout "):
        rank = lane.split()[1]
        return (1, int(rank) if rank.isdigit() else 1 << 30, lane)
    return (2, 0, lane)


def _row(n: int, life: Life) -> dict[str, Any]:
    """One trajectory in the list: its outcome, reward, staleness, step, duration, turns and tokens."""
    events = life.events
    end = life.end
    reward = next((e.get("reward") for e in reversed(events) if e.get("event") in ("trained", "reward")), None)
    gens = [e for e in events if e.get("event") == "generate"]
    costs = [e["cost"] for e in events if isinstance(e.get("cost"), dict | int | float)]
    return {
        "id": n,
        "traj_id": life.traj_id,
        "tag": life.tag,
        "outcome": life.outcome,
        "end_event": end["event"] if end is not None else None,
        "why": None if end is None else end.get("reason") or end.get("error"),
        "reward": _num(reward),
        "staleness": end.get("staleness") if end is not None and end["event"] == "trained" else None,
        "step": end.get("step") if end is not None and end["event"] == "trained" else None,
        "start": _num(events[0].get("t")) if events else None,
        "duration_s": life.duration_s,
        "num_turns": len({e.get("turn") for e in gens}),
        "response_tokens": sum(int(e.get("response_tokens") or 0) for e in gens),
        "workers": sorted({_worker(e.get("rank"), e.get("hardware"), e.get("node_ip")) for e in gens}),
        "migrated": any(e.get("event") == "migrate" for e in events),
        "cost": costs[-1] if costs else None,
    }


__all__ = ["ENDS", "PER_TOKEN_NOTE", "TOKENS_NOTE", "RunFolder"]
