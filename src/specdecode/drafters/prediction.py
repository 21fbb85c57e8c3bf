"""Predicted outputs: draft from text the caller expects the output to be mostly made of (an edit's original).

A request may carry a prediction (OpenAI's ``prediction`` field) whatever the engine's drafter; the engine
then wraps that request's drafter in a :class:`PredictionDrafter`, which follows the prediction while the
output agrees with it and hands over to the wrapped drafter where the prediction has nothing to say.

Following: the drafter keeps its place in the prediction's tokens and drafts what comes next. When the
output departs from it (an edit), it finds its place again: first near where it left the prediction (the
output's last token, if a word, or last two tokens, within a few words after that point: an edit is
usually short), then anywhere by the output's last MIN_TAIL..MAX_TAIL tokens, then (token boundaries
differ around the join) by the output's last characters in the prediction's text, tokenizing the
prediction again from there. After a grammar's forced tokens, not yet verified (``forced.py``), it drafts
from its place past them where they follow the prediction, else hands over as above (to a drafter that can draft
past them). Proposals are deterministic (one-hot), so verification stays exact; the drafter never decides how
far to draft (``control/long.py`` does, from ``long_run``). It keeps nothing between requests.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdecode.drafters.base import Draft, Drafter, DrafterWrapper, StopRule
from specdecode.kv.cache import Cache
from specdecode.kv.prefix import common_prefix
from specdecode.kv.memory import KVMemory
from specdecode.sampling import SamplingParams

NEAR = 48  # characters after the point where the output left the prediction searched for its last token
WORD = 3  # a token of this many characters is evidence enough near that point; shorter ones need two
MAX_TAIL = 8  # longest output tail (tokens) looked up in the prediction's tokens
MIN_TAIL = 3  # shorter tails match unrelated text too often
TEXT_TAIL = 48  # longest output tail (characters) looked up in the prediction's text
MIN_TEXT = 12
WINDOW = 1024  # characters tokenized again after a text match


@dataclass(frozen=True)
class Prediction:
    """A prediction, tokenized alone.

    Args:
        text: the predicted text ("" for a prediction given as token ids: then found again by tokens only).
        ids: its tokens.
        ends: each token's end in ``text`` (characters; without text, its index + 1).
    """

    text: str
    ids: tuple[int, ...]
    ends: tuple[int, ...]
    grams: dict[tuple[int, ...], list[int]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Where each MIN_TAIL-gram starts: finding the place again costs a lookup, not a scan.
        for i in range(len(self.ids) - MIN_TAIL + 1):
            self.grams.setdefault(self.ids[i:i + MIN_TAIL], []).append(i)

    @classmethod
    def of(cls, text: str, tokenizer) -> Prediction:
        """``text`` tokenized by ``tokenizer`` (a ``models.tokenizer.Tokenizer``), without special tokens."""
        ids, ends = tokenizer.encode_with_ends(text)
        return cls(text, tuple(ids), tuple(ends))

    def starts(self, tail: Sequence[int]) -> list[int]:
        """Starts of ``tail`` (at least MIN_TAIL tokens) in ``ids``, in order."""
        n = len(tail)
        head = self.grams.get(tuple(tail[:MIN_TAIL]), [])
        return [i for i in head if self.ids[i:i + n] == tuple(tail)]


@dataclass
class _Place:
    """Tokens being followed (the prediction's, or its text tokenized again from a match) and the next one."""

    ids: Sequence[int]
    ends: Sequence[int]
    next: int = 0


@dataclass
class PredictionDrafter(DrafterWrapper):
    """Drafts the prediction where the output follows it, else asks ``wrapped``.

    Args:
        prediction: the request's prediction.
        wrapped: the engine's drafter for this slot (None: plain decoding where the prediction has nothing).
        tokenizer: for finding the place again by text (None: by tokens only).
    """

    prediction: Prediction
    wrapped: Drafter | None = None
    tokenizer: object | None = None
    drafted: int = 0  # prediction tokens drafted, and accepted, over the request
    accepted: int = 0
    _place: _Place | None = None
    _mark: int = 0  # characters of the prediction the output has followed it through, last time it did
    _seen: int = 0  # tokens of the sequence already looked at
    _prompt_len: int = 0
    _proposed: list[int] = field(default_factory=list)
    _proposed_at: int = 0  # where in the sequence the last proposal starts (after any unverified tokens)

    alone_name = "prediction"

    def reset(self, target_cache: Cache, prompt: Sequence[int] = (), memory: KVMemory | None = None,
              slot: int = 0) -> None:
        super().reset(target_cache, prompt, memory, slot)
        # The output is expected to start where the prediction starts.
        self._place = _Place(self.prediction.ids, self.prediction.ends) if self.prediction.ids else None
        self._seen = self._prompt_len = len(prompt)
        self._mark = 0
        self._proposed = []

    def long_run(self) -> int:
        run = len(self._place.ids) - self._place.next if self._place is not None else 0
        return run or super().long_run()

    @property
    def drafts_past_unverified(self) -> bool:
        # It reads its place over tokens not yet verified (a grammar's forced ones) without moving it: commit moves it.
        return True

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator,
                stop: StopRule | None = None) -> Draft:
        unverified = seq[self._seen:]  # a grammar's forced tokens ahead of this draft (``forced.py``)
        place, self._proposed, self._proposed_at = self._place, [], len(seq)
        if place is not None:
            ahead = place.next + len(unverified)
            if ahead < len(place.ids) and list(place.ids[place.next:ahead]) == unverified:
                self._proposed = list(place.ids[ahead:ahead + k])
                self.drafted += len(self._proposed)
                return Draft(self._proposed)
        if self.wrapped is None or (unverified and not self.wrapped.drafts_past_unverified):
            return Draft([])
        return self.wrapped.propose(seq, k, sampling, generator, stop)

    def commit(self, seq: list[int]) -> None:
        super().commit(seq)
        new = seq[self._seen:]
        self._seen = len(seq)
        self.accepted += common_prefix(self._proposed, seq[self._proposed_at:])
        self._proposed = []
        self._advance(seq, new)

    def _advance(self, seq: list[int], new: list[int]) -> None:
        """Moves along the prediction past ``new`` tokens, or finds the place again where they depart from it."""
        place = self._place
        if place is not None:  # moves as far as the output agrees (all of it, or a long draft up to an edit)
            kept = common_prefix(place.ids[place.next:place.next + len(new)], new)
            place.next += kept
            self._mark = max(self._mark, self._place_end())
            if kept == len(new):
                if place.next < len(place.ids) or place.ends[-1] >= len(self.prediction.text):
                    return
                # The end of a window tokenized again: go on from its last token's end.
                self._place = self._tokenize_from(place.ends[-1])
                return
        output = seq[max(self._prompt_len, len(seq) - MAX_TAIL):]  # the tails looked up are at most this long
        self._place = self._nearby(output) or self._by_tokens(output) or self._by_text(output)

    def _nearby(self, output: list[int]) -> _Place | None:
        """The place after the output's last token found within NEAR characters after ``_mark`` (the first
        such), when that token is a word (WORD characters or more) or the token before it matches too."""
        if not output:
            return None
        ids, ends = self.prediction.ids, self.prediction.ends
        for i in range(bisect.bisect_right(ends, self._mark), bisect.bisect_right(ends, self._mark + NEAR)):
            if ids[i] != output[-1]:
                continue
            start = ends[i - 1] if i else 0
            if ends[i] - start >= WORD or (i and len(output) > 1 and ids[i - 1] == output[-2]):
                return _Place(ids, ends, i + 1)
        return None

    def _by_tokens(self, output: list[int]) -> _Place | None:
        """The place after the longest output tail (MIN_TAIL..MAX_TAIL tokens) found in the prediction's tokens:
        its first occurrence past ``_mark`` (an output goes forward through its source)."""
        ids, ends = self.prediction.ids, self.prediction.ends
        for n in range(min(MAX_TAIL, len(output)), MIN_TAIL - 1, -1):
            tail = output[-n:]
            start = next((s for s in self.prediction.starts(tail) if ends[s] > self._mark), None)
            if start is not None:
                return _Place(ids, ends, start + n)
        return None

    def _by_text(self, output: list[int]) -> _Place | None:
        """The place after the longest output tail (MIN_TEXT..TEXT_TAIL characters) found in the prediction's
        text, tokenized again from there (the join may cut a prediction token in two)."""
        if self.tokenizer is None or not output or not self.prediction.text:
            return None
        tail = self.tokenizer.decode(output[-MAX_TAIL:])[-TEXT_TAIL:]
        text = self.prediction.text
        for n in range(len(tail), MIN_TEXT - 1, -1):
            start = text.find(tail[-n:], max(0, self._mark - n + 1))  # an occurrence that ends past _mark
            if start >= 0:
                return self._tokenize_from(start + n)
        return None

    def _tokenize_from(self, start: int) -> _Place | None:
        """The prediction's text from character ``start`` (at most WINDOW of it) tokenized; a window that ends
        before the text does drops its last token, which the cut may have split."""
        text = self.prediction.text
        if start >= len(text):
            return None
        stop = min(len(text), start + WINDOW)
        ids, ends = self.tokenizer.encode_with_ends(text[start:stop])
        if stop < len(text) and len(ids) > 1:
            ids, ends = ids[:-1], ends[:-1]
        return _Place(ids, [start + e for e in ends]) if ids else None

    def _place_end(self) -> int:
        """Characters of the prediction's text the output has been followed through (0 when lost)."""
        place = self._place
        return place.ends[place.next - 1] if place is not None and place.next else 0
