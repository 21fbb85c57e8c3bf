"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's tail.

Costs no model call. It is deterministic (q is one-hot), so it proposes the same tokens whatever the
temperature. It does not learn or keep any index between requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.drafters.base import Draft, DrafterBase, StopRule
from specdecode.drafters.registry import DrafterInputs, DrafterSpec, register
from specdecode.sampling import SamplingParams


NGRAM_SIGNALS = ("match_len", "occurrences", "agree")
# Earlier occurrences of the tail looked at for the signals (the latest ones).
MAX_OCCURRENCES = 16


@dataclass
class NgramDrafter(DrafterBase):
    """Prompt-lookup drafting over prompt + generated text.

    Its signals (NGRAM_SIGNALS), per proposed token: the matched tail's length, how many earlier
    occurrences of it were found (at most MAX_OCCURRENCES), and the share of those whose continuation
    agrees with the proposal up to this token. They cost one more scan of the sequence.

    Args:
        max_ngram: longest tail to match (tried first, because longer matches predict better).
        min_ngram: shortest tail to match.
    """

    max_ngram: int = 3
    min_ngram: int = 1
    name: str = "ngram"
    drafts_past_unverified = True  # stateless: it reads only the sequence it is handed
    signal_names = NGRAM_SIGNALS

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"ngram sizes need 1 <= min_ngram <= max_ngram, got {self.min_ngram}..{self.max_ngram}")

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator,
                stop: StopRule | None = None) -> Draft:
        n, starts = find_match(seq, self.min_ngram, self.max_ngram, 1 if stop is None else MAX_OCCURRENCES)
        tokens = continuation(seq, starts[0] + n, k) if starts else []
        if stop is None or not tokens:
            return Draft(tokens)
        signals = match_signals(seq, tokens, n, starts)
        end = next((i + 1 for i, signal in enumerate(signals) if stop(i, signal)), len(tokens))
        return Draft(tokens[:end], signals=signals[:end])



def find_match(seq: list[int], min_ngram: int, max_ngram: int, limit: int = 1) -> tuple[int, list[int]]:
    """The longest tail of ``seq`` (``min_ngram``..``max_ngram`` tokens) that occurred earlier.

    Returns:
        (its length, the starts of its latest ``limit`` earlier occurrences, latest first); (0, []) when
        no tail matches.
    """
    top = min(max_ngram, len(seq) - 1)
    if top < min_ngram:
        return 0, []
    # Every earlier occurrence of the last token, latest first, found by list.index (C speed) in the reversed
    # sequence, with how many tokens its tail shares: one pass for all tail lengths instead of a slice per start.
    rev = seq[::-1]
    last, end = rev[0], len(rev)
    found: list[tuple[int, int]] = []  # (index in rev, tail tokens shared)
    full = 0
    j = 0
    try:
        while full < limit:
            j = rev.index(last, j + 1)
            shared = 1
            while shared < top and j + shared < end and rev[j + shared] == rev[shared]:
                shared += 1
            if shared >= min_ngram:
                found.append((j, shared))
                full += shared == top  # enough occurrences of the longest tail: none can beat them
    except ValueError:  # no earlier occurrence left
        pass
    if not found:
        return 0, []
    n = max(shared for _, shared in found)
    return n, [end - j - n for j, shared in found if shared >= n][:limit]


def continuation(seq: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens of ``seq`` from ``start`` on; past the end of ``seq`` they are copied with overlap, as
    LZ77 does: the repetition is assumed to go on."""
    out: list[int] = []
    for i in range(start, start + k):
        out.append(seq[i] if i < len(seq) else out[i - len(seq)])
    return out


def lookup(seq: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Tokens that followed the most recent earlier match of the longest matching tail of ``seq``
    (see :func:`find_match` and :func:`continuation`).

    Args:
        seq: the token sequence so far.
        k: at most this many tokens are returned.
        min_ngram: shortest tail length tried.
        max_ngram: longest tail length tried.
    """
    n, starts = find_match(seq, min_ngram, max_ngram)
    return continuation(seq, starts[0] + n, k) if starts else []


def match_signals(seq: list[int], tokens: list[int], n: int, starts: list[int]) -> list[tuple[float, ...]]:
    """NGRAM_SIGNALS for each proposed token.

    Args:
        seq: the sequence the proposal continues.
        tokens: the proposal (the continuation of ``starts[0]``, which agrees with itself by definition).
        n: the matched tail's length.
        starts: the occurrences found, latest first.
    """
    agreeing = [1] * len(tokens)
    for s in starts[1:]:
        j = 0
        while j < len(tokens) and s + n + j < len(seq) and seq[s + n + j] == tokens[j]:
            agreeing[j] += 1
            j += 1
    count = float(len(starts))
    return [(float(n), count, a / count) for a in agreeing]


def sizes(inputs: DrafterInputs) -> dict[str, int]:
    """``inputs.ngram_sizes`` as an n-gram drafter's keyword arguments (none: its own defaults)."""
    if inputs.ngram_sizes is None:
        return {}
    return {"min_ngram": inputs.ngram_sizes[0], "max_ngram": inputs.ngram_sizes[1]}


register(DrafterSpec("ngram", lambda i: NgramDrafter(**sizes(i)),
                     "n-gram lookup in the prompt and output (prompt lookup)", flags=("--ngram",)))
