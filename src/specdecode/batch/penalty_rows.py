"""The requests' penalties (``sampling.Penalties``: presence, frequency, repetition, ``logit_bias``) on a step's
scored rows: each row penalized by the tokens before it, the drafted ones on its path included, so that acceptance,
sampling and log-probabilities see what plain decoding would after the same tokens. It does not mask (``grammar_rows.py``)
or verify (``acceptance.py``)."""

from __future__ import annotations

import torch

from specdecode.batch.rows import SequenceRows
from specdecode.drafters.base import Draft
from specdecode.sampling import penalize


def row_paths(draft: Draft) -> list[list[int]]:
    """The drafted tokens before each scored row: none before the fed token's row, then each draft token's path
    (a chain's earlier tokens and itself; a tree node's ancestors and itself)."""
    tokens, parents = draft.tokens, draft.parents
    paths: list[list[int]] = [[]]
    for node in range(len(tokens)):
        before = paths[1 + parents[node]] if parents is not None else paths[node]
        paths.append(before + [tokens[node]])
    return paths


def penalize_rows(logits: torch.Tensor, decoding: list[SequenceRows]) -> None:
    """Penalizes in place the rows of ``logits`` ([scored, V]) whose sequences ask for penalties."""
    start = 0
    for part in decoding:
        rows = 1 + len(part.draft.tokens)
        penalties = part.seq.request.sampling.penalties
        if penalties.active:
            penalize(logits[start:start + rows], penalties, part.seq.request.prompt_ids, part.seq.generated,
                     row_paths(part.draft))
        start += rows
