"""The drafter protocol: propose k tokens, then be told what was kept.

A drafter never verifies and never touches the target's output; it only proposes. It may keep its own
state (a KV cache of a draft model) and must roll that state back in ``commit``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from specdecode.kv.cache import Cache
from specdecode.kv.memory import KVMemory
from specdecode.sampling import SamplingParams, probs_from_logits, sample


@dataclass
class Draft:
    """Proposed tokens.

    Args:
        tokens: up to k token ids (fewer, even none, when the drafter has nothing to say).
        q: ``[len(tokens), V]`` the distributions the tokens were drawn from, processed like the
            target's (same temperature/top-k/top-p); None when the drafter is deterministic (one-hot q).
    """

    tokens: list[int]
    q: torch.Tensor | None = None


class Drafter(Protocol):
    name: str

    def reset(self, target_cache: Cache, prompt: Sequence[int] = (), memory: KVMemory | None = None) -> None:
        """Starts a new request (timed as prefill): ``target_cache`` is the cache the target verifies
        with, ``prompt`` the request's token ids, for drafters that prefill their own state, ``memory`` the
        engine's KV budget and prefix caches, where a drafter with a cache of its own allocates it."""

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator) -> Draft:
        """Proposes up to ``k`` tokens to follow ``seq`` (prompt + accepted tokens)."""

    def commit(self, seq: list[int]) -> None:
        """Told the sequence after verification (the previous seq + accepted draft + one target token)."""


def draw(logits: torch.Tensor, sampling: SamplingParams,
         generator: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """Picks one draft token from ``logits [V]``: argmax when greedy (q is one-hot, returned as None),
    else a sample from the same processed distribution the target uses, returned as q."""
    if sampling.greedy:
        return int(logits.argmax()), None
    q = probs_from_logits(logits, sampling)
    return int(sample(q[None], generator)), q


def model_draft(model, cache: Cache, fed: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator, layers=None) -> Draft:
    """Autoregressive drafting with a transformer over its cache.

    Args:
        model: a :class:`~specdecode.models.transformer.Transformer`.
        cache: the cache it reads and appends to (slot 0).
        fed: tokens not yet in the cache (at least the last token of the sequence).
        k: tokens to draft (>= 1).
        sampling: the request's sampling parameters.
        generator: the request's random generator.
        layers: layers to run (None = all).
    """
    tokens, qs = [], []
    logits = model(torch.tensor([fed]), cache, layers=layers, logits="last")[0, -1]
    for i in range(k):
        token, q = draw(logits, sampling, generator)
        tokens.append(token)
        qs.append(q)
        if i + 1 < k:
            logits = model(torch.tensor([[token]]), cache, layers=layers, logits="last")[0, -1]
    return Draft(tokens, None if sampling.greedy else torch.stack(qs))
