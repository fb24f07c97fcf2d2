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


def text_ends(tokenizer: Any, ids: list[int], *, skip_special_tokens: bool = True) -> list[int]:
    """``ends[k]``: how many characters the reply's text has once token ``k`` is added (a token that
    only begins a character adds none until the one that completes it)."""
    ends: list[int] = []
    start, emitted, total = 0, 0, 0
    before = ""  # the text of ids[start:emitted]
    for k in range(len(ids)):
        now = tokenizer.decode(ids[start : k + 1], skip_special_tokens=skip_special_tokens)
        grew = len(now) > len(before)
        if grew and (not now.endswith("\ufffd") or k + 1 - start >= MAX_WINDOW):
            total += len(now) - len(before)
            start, emitted = emitted, k + 1
            before = tokenizer.decode(ids[start:emitted], skip_special_tokens=skip_special_tokens)
        elif k + 1 - start >= 4 * MAX_WINDOW:  # nothing ever grows (e.g. special tokens only): move on
            start = emitted = k + 1
            before = ""
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
