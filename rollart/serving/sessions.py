"""Sessions: every call of an episode recorded with the exact tokens, and the trajectory built from them.

A session is one episode of one agent. Each call it makes records the prompt token ids the engine
consumed (as a :class:`TokenTrace`: which of them the policy generated in earlier calls, with their
behaviour log-probs and policy versions) and, per choice, the ids, log-probs and versions the engine
produced. A call that continues an earlier one (its history is that call's messages, one of its
replies, then new messages) inherits that call's trace, so the trace of the last call is the whole
episode as the engine saw it: :meth:`Session.trajectory` turns it into the
:class:`~rollart.rollout.types.Trajectory` that trains — from the recorded ids, never from text.

A call that continues no earlier call (the harness rewrote its history: a summary, a truncation)
starts a new chain; the trajectory is the chain of the session's last call (``info["chains"]`` counts
the chains, ``info["calls_off_chain"]`` the calls whose tokens do not train).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from rollart.rollout.types import Trajectory


@dataclass
class TokenTrace:
    """Token ids with, per id, whether the policy generated it (loss mask), its behaviour log-prob and
    the policy version that produced it (0.0 / -1 for context tokens), and the span of each reply."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)

    def copy(self) -> TokenTrace:
        return TokenTrace(
            list(self.token_ids), list(self.loss_mask), list(self.logprobs), list(self.versions), list(self.turns)
        )

    def add_context(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_action(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        start = len(self.token_ids)
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions
        self.turns.append((start, len(self.token_ids)))


@dataclass
class ChoiceRecord:
    """One reply as the engine produced it: ``token_ids`` are the ids that train (up to the end of the
    reply; a stop sequence's tokens included), ``key`` identifies it when the history comes back."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    key: Any
    hardware: str = ""
    rank: int = -1  # the inference worker that produced it


@dataclass
class CallRecord:
    index: int
    kind: Literal["chat", "completion"]
    key: Any  # chat: (tools, message keys); completion: the prompt text
    prompt: TokenTrace
    parent: tuple[int, int] | None  # (call, choice) this call continues
    choices: list[ChoiceRecord] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0


class SessionClosed(Exception):
    """The session ended (its episode finished or was aborted); the message says how."""


class Session:
    """One episode's calls. ``id`` is unguessable (it is part of the session's base URL)."""

    def __init__(self, tag: str = "agent", *, max_calls: int = 256, meta: dict[str, Any] | None = None):
        self.id = secrets.token_urlsafe(18)
        self.tag = tag
        self.max_calls = max_calls
        self.meta = dict(meta or {})
        self.calls: list[CallRecord] = []
        self.reward: float | None = None
        self.reward_info: dict[str, Any] = {}
        self.ended: str | None = None  # why the session no longer takes calls
        self.in_flight: set[str] = set()  # request ids being generated
        self.clients: set[str] = set()  # the addresses its calls came from
        self.last_used = time.monotonic()
        self._next_call = 0
        self.rewarded = asyncio.Event()

    def __getstate__(self) -> dict[str, Any]:
        """A session crosses processes (an endpoint process hands a closed one to the driver) without its
        event, which belongs to one event loop."""
        state = dict(self.__dict__)
        state["rewarded"] = self.rewarded.is_set()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        rewarded = state.pop("rewarded")
        self.__dict__.update(state)
        self.rewarded = asyncio.Event()
        if rewarded:
            self.rewarded.set()

    # ------------------------------------------------------------------ calls
    def check_open(self) -> None:
        if self.ended is not None:
            raise SessionClosed(f"session {self.id} has ended ({self.ended})")
        if self._next_call >= self.max_calls:
            raise SessionClosed(f"session {self.id} made its {self.max_calls} calls (max_calls)")

    def new_call_index(self) -> int:
        self.check_open()
        self.last_used = time.monotonic()
        index = self._next_call
        self._next_call += 1
        return index

    def find_parent(self, kind: str, key: Any) -> tuple[CallRecord, ChoiceRecord, int] | None:
        """The recorded (call, choice) this call continues, with how much of the history it covers.

        chat: ``key = (tools, messages)``; a call continues ``(c, choice)`` when it has the same tools and
        its messages start with ``c``'s messages followed by that choice's reply. completion: its prompt
        text starts with ``c``'s prompt followed by the choice's text. The longest match wins."""
        best: tuple[CallRecord, ChoiceRecord, int] | None = None
        for call in self.calls:
            if call.kind != kind:
                continue
            for choice in call.choices:
                if kind == "chat":
                    tools, msgs = key
                    ctools, cmsgs = call.key
                    head = (*cmsgs, choice.key)
                    covered = len(head)
                    if tools != ctools or len(msgs) <= covered or tuple(msgs[:covered]) != head:
                        continue
                else:
                    head_text = call.key + choice.key
                    covered = len(head_text)
                    if not key.startswith(head_text) or len(key) <= covered:
                        continue
                if best is None or covered > best[2]:
                    best = (call, choice, covered)
        return best

    def record(self, call: CallRecord) -> None:
        self.calls.append(call)
        self.last_used = time.monotonic()

    # ------------------------------------------------------------------ end of the episode
    def set_reward(self, value: float, info: dict[str, Any] | None = None) -> None:
        self.reward = float(value)
        self.reward_info = dict(info or {})
        self.rewarded.set()

    def end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why

    def chains(self) -> int:
        return sum(1 for c in self.calls if c.parent is None)

    def last_chain(self) -> list[tuple[CallRecord, int]]:
        """The calls of the chain that ends with the last recorded call (its choice 0), root first."""
        if not self.calls:
            return []
        by_index = {c.index: c for c in self.calls}
        last = max(self.calls, key=lambda c: (c.started + c.seconds, c.index))
        chain = [(last, 0)]
        while chain[-1][0].parent is not None:
            ci, choice = chain[-1][0].parent  # type: ignore[misc]
            chain.append((by_index[ci], choice))
        return chain[::-1]

    def trajectory(self, traj_id: str, group_id: str = "", start_version: int = 0) -> Trajectory:
        """The episode that trains: the last call's prompt trace and its first reply, token-exact."""
        chain = self.last_chain()
        if not chain:
            raise ValueError(f"session {self.id} made no call")
        last, _ = chain[-1]
        choice = last.choices[0]
        trace = last.prompt.copy()
        trace.add_action(choice.token_ids, choice.logprobs, choice.versions)
        root = chain[0][0]
        on_chain = {c.index for c, _ in chain}
        return Trajectory(
            traj_id=traj_id,
            group_id=group_id,
            tag=self.tag,
            token_ids=trace.token_ids,
            loss_mask=trace.loss_mask,
            logprobs=trace.logprobs,
            versions=trace.versions,
            prompt_length=len(root.prompt.token_ids),
            turns=trace.turns,
            reward=self.reward,
            start_version=start_version,
            hardware=[c.choices[i].hardware for c, i in chain if c.choices],
            info={
                "session": self.id,
                "calls": len(self.calls),
                "chains": self.chains(),
                "calls_off_chain": len(self.calls) - len(on_chain),
                "finish_reason": choice.finish_reason,
                "clients": sorted(self.clients),
                **({"reward_info": self.reward_info} if self.reward_info else {}),
            },
        )


class SessionStore:
    """The open sessions of one endpoint, bounded (``max_sessions``); idle ones expire after ``ttl_s``."""

    def __init__(self, max_sessions: int = 4096, ttl_s: float = 3600.0, max_calls: int = 256):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.max_calls = max_calls  # of each session opened here
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, tag: str = "agent", **kwargs: Any) -> Session:
        self.expire()
        if len(self._sessions) >= self.max_sessions:
            raise OverflowError(f"{len(self._sessions)} sessions are open (max_sessions); close some or retry later")
        kwargs.setdefault("max_calls", self.max_calls)
        session = Session(tag, **kwargs)
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session | None:
        session = self._sessions.get(session_id)
        idle = session is not None and not session.in_flight and time.monotonic() - session.last_used > self.ttl_s
        if session is not None and session.ended is None and idle:
            session.end("expired")
        return session

    def close(self, session_id: str, why: str = "closed") -> Session | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            session.end(why)
        return session

    def expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for sid in [s.id for s in self._sessions.values() if s.last_used < cutoff and not s.in_flight]:
            self.close(sid, "expired")
