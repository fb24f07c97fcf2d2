"""Incremental detokenisation: the text each generated token adds, in time linear in the reply.

Decoding every prefix of a reply (``decode(ids[:k])`` for each ``k``) costs time quadratic in its
length: 1.2 s for 4k tokens, on the event loop the endpoint shares with the driver. Here each token
is decoded within a short window of the tokens before it (the approach of incremental detokenisers in
inference servers): the text of ``ids[start:k + 1]`` minus the text of ``ids[start:emitted]``, where
``start`` trails by one emission so that a tokenizer's handling of a leading space or of bytes that
only complete a character together (``\ufffd`` while incomplete) sees the same context both times.
A window that grows past :data:`MAX_WINDOW` tokens without completing a character is emitted as it is,
so a reply of lone continuation bytes stays linear too.
"""

from __future__ import annotations

from typing import Any

MAX_WINDOW = 16


class IncrementalDetokenizer:
    """The text each pushed token adds (``push``), decoded within a short window of the tokens before it:
    a token that only begins a character adds nothing until the one that completes it."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._start = self._emitted = 0
        self._before = ""  # the text of ids[start:emitted]

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        k = len(self.ids) - 1
        now = self.tokenizer.decode(self.ids[self._start : k + 1], skip_special_tokens=self.skip)
        piece = ""
        if len(now) > len(self._before) and (not now.endswith("\ufffd") or k + 1 - self._start >= MAX_WINDOW):
            piece = now[len(self._before) :]
            self._start, self._emitted = self._emitted, k + 1
            self._before = self.tokenizer.decode(self.ids[self._start : self._emitted], skip_special_tokens=self.skip)
        elif k + 1 - self._start >= 4 * MAX_WINDOW:  # nothing ever grows (e.g. special tokens only): move on
            self._start = self._emitted = k + 1
            self._before = ""
        return piece


def text_ends(tokenizer: Any, ids: list[int], *, skip_special_tokens: bool = True) -> list[int]:
    """``ends[k]``: how many characters the reply's text has once token ``k`` is added (a token that
    only begins a character adds none until the one that completes it)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    ends: list[int] = []
    total = 0
    for t in ids:
        total += len(detok.push(t))
        ends.append(total)
    return ends


def pieces(tokenizer: Any, ids: list[int], text: str) -> list[tuple[int, str]]:
    """``text`` (the decoded reply, possibly cut at a stop sequence) split into one piece per token
    that adds characters: ``(index of that token, piece)``. The pieces join to ``text`` exactly; what
    the tokens do not account for is a last piece with index -1."""
    out: list[tuple[int, str]] = []
    sent = 0
    for k, end in enumerate(text_ends(tokenizer, ids)):
        end = min(end, len(text))
        if end > sent:
            out.append((k, text[sent:end]))
            sent = end
    if sent < len(text):
        out.append((-1, text[sent:]))
    return out


def cut_after(tokenizer: Any, ids: list[int], chars: int) -> int:
    """The fewest leading tokens of ``ids`` whose text has at least ``chars`` characters (all of them
    when none do)."""
    for k, end in enumerate(text_ends(tokenizer, ids)):
        if end >= chars:
            return k + 1
    return len(ids)
