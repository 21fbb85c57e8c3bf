"""Dynamic draft trees from a model drafter (EAGLE-2's expansion, Li et al. 2024).

From the drafter's distribution after the sequence, the root gets ``width`` children; then, one drafter
forward per level, the ``expand`` most probable nodes of the newest level (by the product of the draft
probabilities on their path) are run through the drafter over their ancestors and get ``width`` children
each. EAGLE-2 expands several nodes per level; on a CPU each is one more row of every drafter forward,
and expanding one (the default) gave the same accepted length as two on SmolLM2's EAGLE head (1.56 at 4
nodes, 1.60 vs 1.59 at 8) for fewer drafted rows, so siblings come from the expanded node's own
distribution, free. For greedy requests, expansion stops when no node of the newest level could still
rank among the ``budget`` best, and the tree kept is the ``budget`` most probable nodes (a child is never
more probable than its parent, so those nodes always form a tree).

Greedy requests take each node's most probable children (a deterministic tree: q is None). Sampled ones
draw each node's children from the draft distribution without replacement (Gumbel top-k), as the
recursive rejection rule in ``verify.py`` needs. That rule also needs how many siblings a node has not to
depend on the siblings' own values, so a sampled tree keeps whole sibling groups: the budget bounds how
many nodes are expanded, never which drawn children are kept.

This module does not run a model: the drafter passes ``run``, which feeds one level's nodes through its
model and cache (``Transformer.forward_rows`` with ``parents``) and returns their logits; the drafter then
rolls its cache back.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from specdecode.drafters.base import Draft
from specdecode.sampling import SamplingParams, probs_from_logits
from specdecode.tree import path_to

# (tokens of the level's new rows, row-level parents of all rows run so far) -> their logits [n, V]
RunLevel = Callable[[list[int], list[int]], torch.Tensor]


def grow_tree(first: torch.Tensor, run: RunLevel, budget: int, width: int, sampling: SamplingParams,
              generator: torch.Generator, expand: int = 1) -> Draft:
    """Up to ``budget`` nodes, most probable first (module docstring).

    Args:
        first: ``[V]`` the drafter's logits after the sequence (-inf where it may not draft).
        run: feeds a level's nodes to the drafter (see ``RunLevel``); row parents are -1 for children of
            the root (the sequence's last token, already in the drafter's cache).
        budget: most nodes.
        width: children per expanded node.
        expand: nodes expanded per level (each is one more row in the drafter's forward; its children come
            from that row's distribution at no further cost).
        sampling: the request's sampling parameters.
        generator: the request's random generator.
    """
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []  # log of the draft probability of the node's path
    dists: list[int] = []  # per node, the index in ``qs`` of the distribution it was drawn from
    qs: list[torch.Tensor] = []
    rows: dict[int, int] = {}  # expanded node -> its row among the drafter's tree rows
    row_parents: list[int] = []

    def add_children(logits: torch.Tensor, parent: int, count: int) -> list[int]:
        base = scores[parent] if parent >= 0 else 0.0
        picked, probs = _pick(logits, count, sampling, generator)
        if not sampling.greedy:
            qs.append(probs)
        new = []
        for token in picked:
            new.append(len(tokens))
            tokens.append(token)
            parents.append(parent)
            scores.append(base + math.log(max(float(probs[token]), 1e-30)))
            dists.append(len(qs) - 1)
        return new

    level = add_children(first, -1, min(width, budget))
    while level:
        if sampling.greedy:
            cut = sorted(scores, reverse=True)[budget - 1] if len(scores) >= budget else -math.inf
            grow = sorted((n for n in level if scores[n] > cut), key=lambda n: (-scores[n], n))[:expand]
        else:  # whole sibling groups only: as many expansions as the budget holds
            room = (budget - len(tokens)) // width
            grow = sorted(level, key=lambda n: (-scores[n], n))[:min(expand, room)]
        if not grow or len(path_to(parents, grow[0])) >= budget:
            break
        for n in grow:
            rows[n] = len(row_parents)
            row_parents.append(-1 if parents[n] < 0 else rows[parents[n]])
        logits = run([tokens[n] for n in grow], list(row_parents))  # [len(grow), V]
        level = [child for n, row in zip(grow, logits) for child in add_children(row, n, width)]
    if not sampling.greedy:  # every drawn node, in creation order (parents first, siblings in draw order)
        q = torch.stack([qs[dists[n]] for n in range(len(tokens))])
        return Draft(tokens, q, parents=parents)
    kept = sorted(range(len(tokens)), key=lambda n: (-scores[n], n))[:budget]
    number = {old: new for new, old in enumerate(kept)}
    return Draft([tokens[n] for n in kept], parents=[number[parents[n]] if parents[n] >= 0 else -1 for n in kept])


def _pick(logits: torch.Tensor, width: int, sampling: SamplingParams,
          generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """``width`` distinct children of one node and the probabilities that score them: the most probable
    (temperature 1) when greedy, else drawn without replacement from the processed distribution q."""
    if sampling.greedy:
        probs = torch.softmax(logits.float(), -1)
        return probs.topk(min(width, int((probs > 0).sum()))).indices.tolist(), probs
    q = probs_from_logits(logits, sampling)
    # Gumbel top-k: the order of keys log q - log(-log u) is that of drawing without replacement from q.
    u = torch.rand(q.shape, generator=generator, device=q.device).clamp_(min=1e-20)
    keys = torch.where(q > 0, q.log() - (-u.log()).log(), -math.inf)
    return keys.topk(min(width, int((q > 0).sum()))).indices.tolist(), q
