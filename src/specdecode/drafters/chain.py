"""A request's drafter chain: the slot's drafter with what the request adds in front of it.

A request may bring a prediction (drafted where the output follows it, ``prediction.py``) and a grammar (its
forced tokens drafted first, ``forced.py``). :func:`chain_for` wraps the slot's drafter in those, prediction
inside, forced tokens outside, and the engine talks to the :class:`DrafterChain` alone: it drafts, is told what
was kept, and answers what its links know (the forced tokens ahead, the prediction's counts). Unwrapping is
dropping the chain when the request ends: the slot's drafter itself is never changed by it.

Not here: drafting (the drafters), how far to draft (``control/``), verification (``verify.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.drafters.base import Draft, Drafter, DrafterWrapper, StopRule
from specdecode.drafters.forced import ForcedDrafter
from specdecode.drafters.prediction import Prediction, PredictionDrafter
from specdecode.grammar import Constraint
from specdecode.sampling import SamplingParams


@dataclass(frozen=True)
class PredictionCounts:
    """How a request's prediction served it: its tokens, and those drafted from it and accepted."""

    tokens: int
    drafted: int
    accepted: int


@dataclass
class DrafterChain(DrafterWrapper):
    """One request's drafter: ``wrapped`` is the outermost link, which drafts; the links are kept by name.

    Args:
        wrapped: the outermost drafter of the chain (the slot's drafter when the request adds nothing).
        slot_drafter: the engine's drafter for the request's slot (None: plain decoding where no link drafts).
        prediction: the link that follows the request's prediction, if it has one.
        forced: the link that drafts its grammar's forced tokens, if it has a grammar and speculation is on.
    """

    wrapped: Drafter
    slot_drafter: Drafter | None = None
    prediction: PredictionDrafter | None = None
    forced: ForcedDrafter | None = None

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator,
                stop: StopRule | None = None) -> Draft:
        return self.wrapped.propose(seq, k, sampling, generator, stop)

    def forced_ahead(self) -> int:
        """Tokens the grammar forces at the current place (0 without a grammar): drafted on top of the
        controller's choice, since they are all but sure."""
        return len(self.forced.forced_ahead()) if self.forced is not None else 0

    def prediction_counts(self) -> PredictionCounts | None:
        """The prediction's figures for the request's stats; None without a prediction."""
        link = self.prediction
        if link is None:
            return None
        return PredictionCounts(tokens=len(link.prediction.ids), drafted=link.drafted, accepted=link.accepted)


def chain_for(slot_drafter: Drafter | None, prediction: Prediction | None = None,
              constraint: Constraint | None = None, tokenizer: object | None = None) -> DrafterChain | None:
    """The chain a request drafts with; None when nothing drafts (no slot drafter and no prediction).

    Args:
        slot_drafter: the engine's drafter for the slot (None: speculation is off).
        prediction: the request's prediction, drafted wherever the output follows it, speculation on or off.
        constraint: the request's place in its grammar; its forced tokens are drafted when anything drafts.
        tokenizer: finds a lost place in the prediction again by text (None: by tokens only).
    """
    outer = slot_drafter
    following = forcing = None
    if prediction is not None:
        outer = following = PredictionDrafter(prediction, slot_drafter, tokenizer)
    if outer is None:
        return None
    if constraint is not None:
        outer = forcing = ForcedDrafter(constraint, outer)
    return DrafterChain(outer, slot_drafter, following, forcing)
