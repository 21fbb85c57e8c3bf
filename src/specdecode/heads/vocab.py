"""The draft vocabulary: which token ids a head or a draft model may propose, and the reduced output head that
scores them.

A head drafts over a subset of the target's vocabulary (the most frequent tokens of its training data), a
draft model with ``--draft-vocab`` over its first ids, which makes each draft token's output head that much
cheaper. Verification still scores the full vocabulary, so this stays lossless: the draft distribution q is
zero outside the subset and the residual max(0, p - q) keeps the target's mass there. This module does not
train or draft.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch
from torch import nn

from specdecode.models import packing


class DraftVocab(Protocol):
    """What drafting reads of a draft vocabulary (``VocabHead``, ``RequestVocab``): its ids, its logits over
    them, and those logits spread over the whole vocabulary."""

    ids: torch.Tensor  # [Vd] token ids, one per logit

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...  # [..., h] -> [..., Vd] float32

    def full(self, logits: torch.Tensor) -> torch.Tensor: ...  # [..., Vd] -> [..., V], -inf outside


def frequency_ranking(counts: torch.Tensor, always: Iterable[int] = ()) -> torch.Tensor:
    """Every token id, most frequent first (``always`` before all, e.g. end-of-sequence ids; ties by id,
    so that equal counts give one answer on every machine). A draft vocabulary of size n is its first n.

    Args:
        counts: ``[V]`` occurrences of each id in the training data.
        always: ids ranked first whatever their count.
    """
    boosted = counts.double().clone()
    boosted[list(always)] = float("inf")
    order = sorted(range(counts.numel()), key=lambda i: (-boosted[i].item(), i))
    return torch.tensor(order, dtype=torch.int64)


def id_ranking(vocab_size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """Every token id in id order, ``always`` first: the ranking of a model without counts (a draft model). A
    BPE vocabulary lists its tokens in merge order (SentencePiece's by score), which is roughly most frequent
    first in English and code (the first 65536 of Qwen2.5's 151936 ids hold 98% of the bench suites' prompt
    tokens), not in every language (half of a Chinese text's)."""
    first = torch.tensor(sorted(set(always)), dtype=torch.int64)
    if first.numel() and not 0 <= int(first[0]) <= int(first[-1]) < vocab_size:
        raise ValueError(f"ids always in a draft vocabulary must lie in 0..{vocab_size - 1}, got {first.tolist()}")
    rest = torch.ones(vocab_size, dtype=torch.bool)
    rest[first] = False
    return torch.cat([first, torch.arange(vocab_size)[rest]])


def spread(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[..., Vd]`` logits of ``ids`` -> ``[..., vocab_size]`` with -inf at every other id."""
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    out[..., ids] = logits
    return out


def draft_ids(ranking: torch.Tensor, size: int) -> torch.Tensor:
    """The draft vocabulary of ``size`` tokens (0, or at least the vocabulary: all of them), sorted by id."""
    if size <= 0 or size >= ranking.numel():
        size = ranking.numel()
    return ranking[:size].sort().values


class VocabHead(nn.Module):
    """A model's output head restricted to ``ids``: ``[..., h]`` -> ``[..., Vd]`` logits in float32.

    Args:
        target: the ``Transformer`` whose output head it restricts: the target for a trained head, the draft
            model itself for a draft model (its rows are copied once, then packed for its backend like its
            projections; a head in a block format gives its own blocks, so both score with the same weights).
        ids: ``[Vd]`` token ids (kept sorted: row i scores the i-th smallest id, so that the first of equal
            logits is the lowest id, as over the whole vocabulary).
    """

    def __init__(self, target, ids: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("ids", ids.to(target.device, torch.int64).sort().values)
        self.vocab_size = target.config.vocab_size
        held = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.ids.device)
        held[self.ids] = True
        self.register_buffer("held", held)  # [V]: True at ids
        backend = target.backend
        if packing.block_weights(target):
            self.linear = backend.block_linear(target.head_layer.block_rows(self.ids.cpu()), None)
        else:
            self.linear = backend.linear(target.output_rows(self.ids), None)  # rows [Vd, h]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).float()

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., Vd]`` draft logits -> ``[..., V]`` with -inf outside the draft vocabulary."""
        return spread(logits, self.ids, self.vocab_size)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.linear.parameters(), *self.linear.buffers()])


class RequestVocab:
    """A shared draft vocabulary widened by one request's own tokens: the ids its prompt and output hold outside
    ``base`` are scored too, with ``model``'s own output rows (in float32). A draft model's first ids rank
    English and code well and other languages poorly; the request's text names the tokens it is made of.

    Its ``ids`` are ``base``'s, then the request's in the order they came (not sorted: a tie picks the earlier).
    It has ``VocabHead``'s interface for drafting (``__call__``, ``ids``, ``full``).

    Args:
        base: the shared draft vocabulary's head.
        model: the ``Transformer`` whose output rows score the request's ids (the one ``base`` restricts).
    """

    def __init__(self, base: VocabHead, model) -> None:
        self.base, self.model, self.vocab_size = base, model, base.vocab_size
        self.ids = base.ids
        self._held = base.held.clone()
        self._rows = torch.empty(0, model.config.hidden_size, device=base.ids.device)  # [k, h] float32

    def add(self, tokens: Iterable[int]) -> None:
        """Makes ``tokens`` (ids of the request's text) draftable where they are not yet."""
        new = torch.tensor(sorted(set(tokens)), dtype=torch.int64, device=self.ids.device)
        new = new[~self._held[new]] if new.numel() else new
        if not new.numel():
            return
        self._held[new] = True
        self._rows = torch.cat([self._rows, self.model.output_rows(new).float()])
        self.ids = torch.cat([self.ids, new])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., h]`` -> ``[..., len(ids)]`` float32 logits."""
        logits = self.base(x)
        if not self._rows.numel():
            return logits
        return torch.cat([logits, x.float() @ self._rows.T], dim=-1)

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., len(ids)]`` draft logits -> ``[..., V]`` with -inf outside."""
        return spread(logits, self.ids, self.vocab_size)
