"""Forced tokens as drafts: what a request's grammar leaves no choice about is drafted ahead of its drafter.

Inside JSON most of the text is forced by the schema (keys, quotes, braces, separators, the rest of an enum
value). The grammar's forced text, tokenized (``Constraint.forced``: a token that a longer one could replace
at the forced text's end is left out), is drafted one-hot and still verified: the target's masked
distribution keeps other tokenizations of the same bytes, and decides. The request's own drafter then drafts
after the forced tokens where it can draft past tokens not yet verified (``drafts_past_unverified``), else
the draft ends with them. A sampled draft's q gets one-hot rows for the forced tokens, the rule for a
deterministic proposal, so acceptance stays exact.

``within`` cuts a draft where the grammar refuses it. This module does not mask rows (``grammar.py``) or decide a
draft's length (the engine does, from ``forced_ahead`` and the controller).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdecode import tree
from specdecode.drafters.base import Draft, Drafter, DrafterWrapper, StopRule
from specdecode.grammar import Constraint
from specdecode.kv.cache import Cache
from specdecode.kv.memory import KVMemory
from specdecode.sampling import SamplingParams


@dataclass
class ForcedDrafter(DrafterWrapper):
    """Drafts the grammar's forced tokens, then ``wrapped``'s proposal after them.

    Args:
        constraint: the request's place in its grammar.
        wrapped: the request's drafter.
    """

    constraint: Constraint
    wrapped: Drafter
    _ahead: list[int] | None = None  # the forced tokens at the current place (None: not computed yet)

    def reset(self, target_cache: Cache, prompt: Sequence[int] = (), memory: KVMemory | None = None,
              slot: int = 0) -> None:
        super().reset(target_cache, prompt, memory, slot)
        self._ahead = None

    def forced_ahead(self) -> list[int]:
        """The tokens the grammar forces next (computed once per place)."""
        if self._ahead is None:
            self._ahead = self.constraint.forced()
        return self._ahead

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator,
                stop: StopRule | None = None) -> Draft:
        forced = self.forced_ahead()[:k]
        if not forced:
            return self.wrapped.propose(seq, k, sampling, generator, stop)
        if len(forced) == k or not self.wrapped.drafts_past_unverified:
            return Draft(list(forced), forced=len(forced))
        rest = self.wrapped.propose(seq + forced, k - len(forced), sampling, generator, stop)
        return _joined(forced, rest)

    def commit(self, seq: list[int]) -> None:
        super().commit(seq)
        self._ahead = None


def _joined(forced: list[int], rest: Draft) -> Draft:
    """The forced chain followed by ``rest`` (a chain or a tree hanging from the last forced token)."""
    f = len(forced)
    q = rest.q
    if q is not None:  # one-hot rows: a deterministic proposal's q
        one_hot = torch.zeros(f, q.shape[-1], dtype=q.dtype, device=q.device)
        one_hot[torch.arange(f), torch.tensor(forced)] = 1.0
        q = torch.cat([one_hot, q])
    parents = None
    if rest.parents is not None:
        parents = tree.chain_parents(f) + [p + f if p >= 0 else f - 1 for p in rest.parents]
    return Draft(forced + rest.tokens, q, list(rest.signals), parents, forced=f)


def within(draft: Draft, constraint: Constraint) -> Draft:
    """``draft`` cut where the grammar refuses it, so that no row is spent past a token that cannot be kept.

    A one-hot chain ends before its first refused token: the target's masked row never picks it, so the outcome
    is the same. A sampled chain (q) keeps that token and ends after it: its rejection (certain, as p of it is 0)
    must still draw from the residual max(0, p - q), which is what keeps the output's distribution exact; an
    uncut tail would never be reached. Trees are left whole (their refused nodes are never accepted).
    """
    if draft.parents is not None or not draft.tokens:
        return draft
    valid = constraint.valid(draft.tokens)
    n = valid if draft.q is None else min(len(draft.tokens), valid + 1)
    if n == len(draft.tokens):
        return draft
    q = draft.q[:n] if draft.q is not None else None
    return Draft(draft.tokens[:n], q, draft.signals[:max(0, n - draft.forced)], None, min(draft.forced, n))
