"""The grammar's part of a step's scored rows: each constrained row's mask, the steps a grammar decides alone, and
the masking of the logits, so that acceptance, sampling and log-probabilities all follow the constrained
distribution.

Masks depend only on the drafts, so they are computed before the forward. It does not compile grammars or advance
them (``grammar.py``, ``acceptance.py``).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from specdecode.batch.rows import SequenceRows
from specdecode.batch.sequence import SequenceState
from specdecode.grammar import mask_rows, sole_tokens


def grammar_masks(decoding: list[SequenceRows]) -> dict[SequenceState, np.ndarray]:
    """The allowed tokens at each scored row of the sequences under a grammar (``Constraint.masks``)."""
    masks = {}
    for part in decoding:
        seq = part.seq
        if seq.constraint is not None:
            tick = time.perf_counter()
            masks[seq] = seq.constraint.masks(part.draft.tokens, part.draft.parents)
            seq.stats.grammar_s += time.perf_counter() - tick
    return masks


def decided(decoding: list[SequenceRows], masks: dict[SequenceState, np.ndarray]) -> list[int]:
    """Each scored row's token when the grammars leave every scored row of the step one token (in JSON: keys,
    quotes, separators; a third of plain constrained steps in the bench's structured suite), else []: such rows'
    masked distributions are that token alone, whatever the logits, and the step needs no output head. (Leaving
    only some rows of a step out of the head, and reassembling the logits, was no faster with n-gram drafts in
    three paired runs: our kernels run the head's rows in pairs.)"""
    tokens: list[int] = []
    for part in decoding:
        rows = masks.get(part.seq)
        sole = sole_tokens(rows) if rows is not None else {}
        if len(sole) != 1 + len(part.draft.tokens):
            return []
        tokens += [sole[row] for row in range(len(sole))]
    return tokens


def one_hot(tokens: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[len(tokens), V]`` logits of rows whose grammar allows one token: 0 for it, -inf elsewhere (the masked
    row's log-probabilities: 0 for the token, no alternative)."""
    logits = torch.full((len(tokens), vocab_size), float("-inf"), dtype=torch.float32, device=device)
    logits[range(len(tokens)), tokens] = 0.0
    return logits


def mask_constrained(logits: torch.Tensor, decoding: list[SequenceRows],
                     masks: dict[SequenceState, np.ndarray]) -> None:
    """Masks the rows of sequences under a grammar in place (``logits`` [scored, V])."""
    start = 0
    for part in decoding:
        seq = part.seq
        if seq in masks:
            tick = time.perf_counter()
            mask_rows(logits, start, masks[seq])
            seq.stats.grammar_s += time.perf_counter() - tick
        start += 1 + len(part.draft.tokens)
