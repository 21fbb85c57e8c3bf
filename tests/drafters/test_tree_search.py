"""Dynamic tree expansion over a stand-in drafter (a fixed table of next-token logits)."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.drafters.tree_search import grow_tree
from specdecode.sampling import SamplingParams
from specdecode.tree import check_tree, depths, path_to

V = 8


def _table(seed: int) -> torch.Tensor:
    """Next-token logits ``[V, V]`` given the last token: the stand-in drafter is a bigram model."""
    return 3 * torch.randn(V, V, generator=torch.Generator().manual_seed(seed))


def _grow(table: torch.Tensor, budget: int, width: int, sampling: SamplingParams, seed: int = 0, expand: int = 1):
    levels: list[tuple[list[int], list[int]]] = []

    def run(tokens, parents):
        levels.append((list(tokens), list(parents)))
        return table[torch.tensor(tokens)]
    draft = grow_tree(table[0], run, budget, width, sampling, torch.Generator().manual_seed(seed), expand)
    return draft, levels


def _path_logprob(table, tokens, parents, node) -> float:
    logp = torch.log_softmax(table, -1)
    prev, total = 0, 0.0
    for n in path_to(parents, node):
        total += float(logp[prev, tokens[n]])
        prev = tokens[n]
    return total


@pytest.mark.parametrize("budget, width, expand", [(1, 2, 1), (4, 2, 1), (8, 3, 1), (12, 2, 1), (8, 3, 2), (12, 2, 2)])
def test_greedy_trees_keep_the_most_probable_nodes(budget, width, expand):
    table = _table(1)
    draft, levels = _grow(table, budget, width, SamplingParams(), expand=expand)
    check_tree(draft.tokens, draft.parents)
    assert len(draft.tokens) == budget and draft.q is None
    scores = [_path_logprob(table, draft.tokens, draft.parents, n) for n in range(budget)]
    assert scores == sorted(scores, reverse=True)  # numbered most probable first
    # No level ran more than ``expand`` rows through the drafter, and one forward per level.
    assert all(len(tokens) <= expand for tokens, _ in levels)
    assert len(levels) <= max(depths(draft.parents))
    # The root's children are the drafter's top tokens.
    assert set(draft.tokens[n] for n in range(budget) if draft.parents[n] < 0) <= set(table[0].topk(width).indices.tolist())


def test_a_confident_drafter_grows_a_deep_chain():
    table = torch.full((V, V), -20.0)
    for t in range(V):
        table[t, (t + 1) % V] = 20.0  # next token is certain
    draft, _ = _grow(table, 5, 2, SamplingParams())
    assert draft.tokens[:5] == [1, 2, 3, 4, 5] and draft.parents[:5] == [-1, 0, 1, 2, 3]


def test_sampled_trees_keep_whole_sibling_groups_drawn_without_replacement():
    table = _table(2)
    sampling = SamplingParams(temperature=1.0)
    for seed in range(20):
        draft, _ = _grow(table, 7, 3, sampling, seed)
        check_tree(draft.tokens, draft.parents)  # siblings are distinct
        groups = {}
        for n, p in enumerate(draft.parents):
            groups.setdefault(p, []).append(n)
        assert all(len(g) == 3 for g in groups.values())  # 3 + 3 nodes: the budget's room, whole groups
        assert len(draft.tokens) == 6 and draft.q.shape == (6, V)
        for parent, group in groups.items():
            prev = 0 if parent < 0 else draft.tokens[parent]
            expected = torch.softmax(table[prev], -1)
            assert all(torch.allclose(draft.q[n], expected) for n in group)


def test_sampled_siblings_follow_draws_without_replacement():
    """The first child follows q, the second q without the first (frequencies over many trees)."""
    table = _table(3)
    q = torch.softmax(table[0], -1)
    first, second = torch.zeros(V), torch.zeros(V)
    n = 4000
    for seed in range(n):
        draft, _ = _grow(table, 2, 2, SamplingParams(temperature=1.0), seed)
        first[draft.tokens[0]] += 1
        second[draft.tokens[1]] += 1
    assert torch.allclose(first / n, q, atol=0.03)
    expected_second = sum(q[a] * torch.where(torch.arange(V) == a, 0.0, q / (1 - q[a])) for a in range(V))
    assert torch.allclose(second / n, expected_second, atol=0.03)
    assert not math.isclose(float(expected_second.max()), float(q.max()), abs_tol=0.03)  # the two differ
