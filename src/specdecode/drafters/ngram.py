"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's tail.

Costs no model call. It is deterministic (q is one-hot), so it proposes the same tokens whatever the
temperature. It does not learn or keep any index between requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdecode.drafters.base import Draft
from specdecode.kv.cache import Cache
from specdecode.kv.memory import KVMemory
from specdecode.sampling import SamplingParams


@dataclass
class NgramDrafter:
    """Prompt-lookup drafting over prompt + generated text.

    Args:
        max_ngram: longest tail to match (tried first, because longer matches predict better).
        min_ngram: shortest tail to match.
    """

    max_ngram: int = 3
    min_ngram: int = 1
    name: str = "ngram"

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"ngram sizes need 1 <= min_ngram <= max_ngram, got {self.min_ngram}..{self.max_ngram}")

    def reset(self, target_cache: Cache, prompt: Sequence[int] = (), memory: KVMemory | None = None) -> None:
        pass

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator) -> Draft:
        return Draft(lookup(seq, k, self.min_ngram, self.max_ngram))

    def commit(self, seq: list[int]) -> None:
        pass


def lookup(seq: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Tokens that followed the most recent earlier match of the longest matching tail of ``seq``.

    When the continuation runs into the end of ``seq`` (the text repeats with a short period), it is
    extended by copying with overlap, as LZ77 does: the repetition is assumed to go on.

    Args:
        seq: the token sequence so far.
        k: at most this many tokens are returned.
        min_ngram: shortest tail length tried.
        max_ngram: longest tail length tried.
    """
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        tail = seq[-n:]
        # Scan right to left: the latest occurrence tends to continue the way the text goes now.
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == tail:
                out: list[int] = []
                for i in range(start + n, start + n + k):
                    out.append(seq[i] if i < len(seq) else out[i - len(seq)])
                return out
    return []
