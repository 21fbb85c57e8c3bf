"""Generated token ids to text, incrementally, and where stop strings end generation.

:class:`Detokenizer` decodes only a short window of the newest ids per token (the previous token's
text as context, so that merges and leading spaces come out as a full decode gives them): a long
generation costs O(n) decoding, not O(n^2). It holds back a trailing incomplete UTF-8 character until
its last byte arrives. :func:`find_stop` and :func:`stream_safe_length` say where stop strings cut the
text and how much of it may be shown while it can still grow into one.

This module does not tokenize prompts or render chat templates (``models/tokenizer.py``).
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence

INCOMPLETE = "\ufffd"  # what a decoder returns for a UTF-8 character whose bytes are not all there yet


class Decoder(Protocol):
    def decode(self, ids: Iterable[int]) -> str: ...


class Detokenizer:
    """The text of a growing token sequence, one token at a time.

    Args:
        tokenizer: anything with ``decode(ids) -> str`` (None: every token decodes to "").
        skip: ids left out of the text (end-of-sequence tokens).
    """

    def __init__(self, tokenizer: Decoder | None, skip: Iterable[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip = frozenset(skip)
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] were decoded last time: the context of the next decode
        self._read = 0  # ids whose text is in ``text``
        self.text = ""

    def add(self, token: int) -> str:
        """Appends one token and returns the text it completes ("" while a character is incomplete)."""
        if token in self._skip or self._tokenizer is None:
            return ""
        self._ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end, shown as U+FFFD as a full decode would)."""
        return self._advance(final=True) if self._read < len(self._ids) else ""

    def _advance(self, final: bool) -> str:
        known = self._tokenizer.decode(self._ids[self._prefix:self._read])
        full = self._tokenizer.decode(self._ids[self._prefix:])
        if not final and (len(full) <= len(known) or full.endswith(INCOMPLETE)):
            return ""
        new = full[len(known):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += new
        return new


def find_stop(text: str, stop: Sequence[str], since: int = 0) -> int | None:
    """Index in ``text`` of the earliest stop string that ends at or after ``since`` (None: none does).

    Args:
        text: the text so far.
        stop: stop strings (non-empty).
        since: characters before it were searched already; only matches reaching past it are new.
    """
    if not stop:
        return None
    start = max(0, since - max(map(len, stop)) + 1)
    found = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(found) if found else None


def stream_safe_length(text: str, stop: Sequence[str]) -> int:
    """How much of ``text`` may be streamed: all of it but a tail that could still grow into a stop string."""
    for keep in range(min(len(text), max(map(len, stop), default=1) - 1), 0, -1):
        tail = text[-keep:]
        if any(s.startswith(tail) for s in stop):
            return len(text) - keep
    return len(text)
