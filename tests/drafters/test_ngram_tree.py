"""Prompt lookup as a tree: the trie of earlier continuations under a node budget."""

from __future__ import annotations

import pytest
import torch

from specdecode.drafters import DrafterInputs, registry
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.ngram_tree import NgramTreeDrafter, merge_continuations
from specdecode.sampling import SamplingParams
from specdecode.tree import check_tree, depths

GREEDY = SamplingParams()


def _propose(drafter, seq: list[int], k: int):
    return drafter.propose(seq, k, GREEDY, torch.Generator())


def test_continuations_merge_into_a_trie_most_frequent_first():
    # Three occurrences: two continue 7 8 9, one 7 5; the latest (first) is 7 5.
    tokens, parents = merge_continuations([[7, 5, 1], [7, 8, 9], [7, 8, 9]], budget=10)
    assert tokens == [7, 8, 9, 5, 1] and parents == [-1, 0, 1, 0, 3]
    check_tree(tokens, parents)


@pytest.mark.parametrize("budget", range(1, 6))
def test_a_budget_keeps_a_tree(budget):
    tokens, parents = merge_continuations([[7, 5, 1], [7, 8, 9], [6, 8, 9], [7, 8, 2]], budget)
    assert len(tokens) == budget
    check_tree(tokens, parents)  # every kept node's parent is kept and numbered before it
    assert tokens[0] == 7


def test_the_tree_holds_alternatives_where_earlier_continuations_disagree():
    seq = [1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 3, 9, 1, 2]  # after "1 2": 4 8 1 2 (twice), 3 9 (latest, once)
    draft = _propose(NgramTreeDrafter(max_ngram=2), seq, k=5)
    assert draft.q is None
    # The twice-seen branch first, then the latest occurrence's, which is all the ngram chain holds.
    assert (draft.tokens, draft.parents) == ([4, 8, 1, 2, 3], [-1, 0, 1, 2, -1])
    assert _propose(NgramDrafter(max_ngram=2), seq, k=2).tokens == [3, 9]


def test_one_occurrence_gives_the_chain_ngram_proposes():
    seq = [5, 6, 7, 8, 9, 10, 5, 6]
    draft = _propose(NgramTreeDrafter(), seq, k=5)
    assert draft.tokens == _propose(NgramDrafter(), seq, k=5).tokens
    assert draft.parents == [-1, 0, 1, 2, 3]


def test_no_match_proposes_nothing():
    assert _propose(NgramTreeDrafter(), [1, 2, 3, 4], k=4).tokens == []


@pytest.mark.parametrize("kwargs, message", [(dict(min_ngram=3, max_ngram=2), "1 <= min_ngram <= max_ngram"),
                                             (dict(occurrences=0), "occurrences >= 1")])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NgramTreeDrafter(**kwargs)


def test_the_registry_builds_it_with_the_ngram_sizes():
    drafter = registry.build("ngram-tree", DrafterInputs(target=None, ngram_sizes=(2, 4)))
    assert isinstance(drafter, NgramTreeDrafter) and (drafter.min_ngram, drafter.max_ngram) == (2, 4)
