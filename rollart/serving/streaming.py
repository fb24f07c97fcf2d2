"""Live streaming of a call's replies: tokens to text pieces as the engine decodes them.

A streamed call (``stream: true`` on any of the four APIs) runs as the service's ordinary call with a
:class:`LiveCall` as its sink: the LLMProxy's deltas (:class:`~rollart.rollout.types.GenerateDelta`)
of each choice are detokenised incrementally (:class:`~rollart.serving.detok.IncrementalDetokenizer`)
and the text that can no longer change is queued for the response at once. What is sent is always a
prefix of the reply's final content, so a client that joins the pieces gets the non-streamed answer:

- text that may turn out to be the start of a stop sequence (the last ``len(longest stop) - 1``
  characters, or a stop sequence found) waits;
- with tools and the ``hermes`` parser, text from a ``<tool_call>`` opening (or what may begin one)
  waits, as does trailing whitespace (content around parsed calls is stripped) and a reply that begins
  with whitespace; with another parser, or a forced tool call (its opening is part of the content), the
  whole text waits;
- the rest is sent with the call's end, when the reply is cut, parsed and recorded exactly as a
  non-streamed call's (the recorded tokens, log-probs and versions are the final outputs', whatever
  was streamed).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollart.rollout.types import GenerateDelta
from rollart.serving.detok import IncrementalDetokenizer

log = logging.getLogger(__name__)

TOOL_OPENING = "<tool_call>"  # where the hermes parser's calls begin


@dataclass(frozen=True)
class HoldRule:
    """What text of a reply may not be sent before the reply ends (see the module's docstring)."""

    stops: tuple[str, ...] = ()
    marker: str | None = None  # text from this opening on waits (a tool call)
    hold_all: bool = False

    def safe(self, text: str, since: int) -> int:
        """How many leading characters of ``text`` (the reply so far) are final; ``since``: how many
        were found final before (the search starts a little before it)."""
        if self.hold_all or not text:
            return 0
        end = len(text)
        if self.stops:
            longest = max(len(s) for s in self.stops)
            lo = max(0, since - longest)
            for s in self.stops:
                p = text.find(s, lo)
                if p >= 0:
                    end = min(end, p)
            end = min(end, len(text) - longest + 1)
        if self.marker is not None:
            if text[0].isspace():  # stripped if the reply holds a call: known only at its end
                return 0
            p = text.find(self.marker, max(0, since - len(self.marker)))
            if p >= 0:
                end = min(end, p)
            else:
                for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
                    if text.endswith(self.marker[:k]):
                        end = min(end, len(text) - k)
                        break
            while end > 0 and text[end - 1].isspace():
                end -= 1
        return max(end, 0)


def hold_rule(stops: list[str] | None, tools: bool, parser: Any, forced: bool) -> HoldRule:
    """The rule of a call: its stop sequences; whether tool calls are parsed (``tools``), by which parser,
    and whether a call is forced."""
    from rollart.serving.tools import hermes

    live_stops = tuple(s for s in stops or [] if s)
    if tools and (forced or parser is not hermes):
        return HoldRule(live_stops, hold_all=True)
    return HoldRule(live_stops, marker=TOOL_OPENING if tools else None)


@dataclass
class LiveReply:
    """One choice as it streams: its content tokens (special ones left out, as in the reply's
    ``logprobs``), their text and how much of it was sent."""

    detok: IncrementalDetokenizer
    special: frozenset[int]
    rule: HoldRule
    text: str = ""
    ends: list[int] = field(default_factory=list)  # text length once each content token is added
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    sent_chars: int = 0
    sent_tokens: int = 0  # content tokens whose whole text was sent

    def add(self, delta: GenerateDelta) -> tuple[str, int, int] | None:
        """Take a delta; the text now final, with the content tokens it completes ``[a, b)``."""
        tops = delta.top_logprobs or [[] for _ in delta.token_ids]
        for t, lp, top in zip(delta.token_ids, delta.logprobs or [0.0] * len(delta.token_ids), tops):
            if t in self.special:
                continue
            self.text += self.detok.push(t)
            self.ends.append(len(self.text))
            self.token_ids.append(t)
            self.logprobs.append(lp)
            self.top.append(top)
        safe = self.rule.safe(self.text, self.sent_chars)
        if safe <= self.sent_chars:
            return None
        piece = self.text[self.sent_chars : safe]
        a, self.sent_chars = self.sent_tokens, safe
        self.sent_tokens = bisect.bisect_right(self.ends, safe)
        return piece, a, self.sent_tokens

    def rest(self, content: str) -> str:
        """What of the final ``content`` was not sent (all of it past what was)."""
        if not content.startswith(self.text[: self.sent_chars]):  # cannot be taken back: say so
            log.warning(
                "a streamed reply's final text differs from what was sent (%r...); the client has the sent text",
                self.text[: min(self.sent_chars, 40)],
            )
        return content[self.sent_chars :]


Piece = tuple[int, str, int, int]  # (choice index, text, first and end content token)


class LiveCall:
    """A streamed call: the sink the service sends each choice's deltas to, and the pieces of text the
    response sends, in order. ``run(sink)`` is the service's call (it returns its ``Result``)."""

    def __init__(self, tokenizer: Any, rule: HoldRule, run: Callable[[LiveCall], Awaitable[Any]]):
        self.tokenizer = tokenizer
        self.rule = rule
        self.special = frozenset(getattr(tokenizer, "all_special_ids", []) or [])
        self.prompt_tokens = 0
        self.replies: dict[int, LiveReply] = {}
        self._queue: asyncio.Queue[Piece | None] = asyncio.Queue()
        self._first: Piece | None = None
        self.task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(run(self))
        self.task.add_done_callback(lambda _: self._queue.put_nowait(None))

    # ------------------------------------------------------------------ the service's side
    def started(self, prompt_tokens: int, n: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.replies = {i: LiveReply(IncrementalDetokenizer(self.tokenizer), self.special, self.rule) for i in range(n)}

    def delta(self, index: int, delta: GenerateDelta) -> None:
        reply = self.replies.get(index)
        piece = reply.add(delta) if reply is not None else None
        if piece is not None:
            self._queue.put_nowait((index, *piece))

    # ------------------------------------------------------------------ the response's side
    async def first(self) -> bool:
        """Wait for the first piece (True) or the call's end (False); a call that failed before any
        piece raises its error here, before the response begins."""
        self._first = await self._queue.get()
        if self._first is None:
            self.task.result()
            return False
        return True

    async def pieces(self) -> AsyncIterator[Piece]:
        """The pieces as they come, until the call ends (then :attr:`task` holds its result or error)."""
        item = self._first
        while item is not None:
            yield item
            item = await self._queue.get()

    def rest(self, index: int, content: str) -> tuple[str, int]:
        """Choice ``index``'s unsent content and its first unsent content token."""
        reply = self.replies.get(index)
        if reply is None:
            return content, 0
        return reply.rest(content), reply.sent_tokens
