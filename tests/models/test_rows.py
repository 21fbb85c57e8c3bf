"""The rows of a forward (``rows.py``): which rows ``LogitRows`` picks, and where ``plan_rows`` places a ragged
forward's rows (consecutive tokens and token trees), refusing what does not fit before anything is written."""

from __future__ import annotations

import pytest
import torch

from specdecode.kv.cache import CacheConfig, KVCache
from specdecode.models.rows import LogitRows, plan_rows

CPU = torch.device("cpu")


def _cache(lengths: list[int]) -> KVCache:
    cache = KVCache(2, 2, 8, CacheConfig(max_len=32, slots=len(lengths)))
    for slot, n in enumerate(lengths):
        cache.advance([slot], n)
    return cache


def test_logit_rows_pick_all_last_none_or_given_rows():
    counts = (1, 4, 2)
    assert LogitRows.ALL.of_rows(counts, CPU) == slice(None) and LogitRows.ALL.wanted
    assert LogitRows.LAST.of_rows(counts, CPU).tolist() == [0, 4, 6] and LogitRows.LAST.last
    assert not LogitRows.NONE.wanted
    assert LogitRows.at(torch.tensor([5, 2])).of_rows(counts, CPU).tolist() == [5, 2]
    assert LogitRows.LAST.of_positions() == slice(-1, None) and LogitRows.ALL.of_positions() == slice(None)
    with pytest.raises(ValueError, match="batched forward scores ALL, LAST or NONE"):
        LogitRows.at(torch.tensor([0])).of_positions()
    with pytest.raises(ValueError, match=r"1-D integer tensor of row indices, got torch.int64 of shape \(1, 2\)"):
        LogitRows.at(torch.tensor([[0, 1]]))


def test_consecutive_rows_continue_each_slot():
    plan = plan_rows(_cache([5, 0, 9]), (2, 0), (3, 1), 4, None, None, CPU)
    assert plan.positions.tolist() == [9, 10, 11, 5] and plan.length == 12
    assert list(plan.starts) == [9, 5] and plan.trees == [None, None]


def test_a_tree_sits_at_its_contexts_length_plus_its_depth():
    plan = plan_rows(_cache([6, 2]), (0, 1), (4, 2), 6, [[-1, 0, 0, 1], None], None, CPU)
    assert plan.positions.tolist() == [6, 7, 7, 8, 2, 3]
    index, counts = plan.trees[0]
    assert counts.tolist() == [7, 8, 8, 9]  # the context, its ancestors and itself
    assert index[2, :8].tolist() == [0, 1, 2, 3, 4, 5, 6, 8]  # row 2 skips its sibling row 1 (key 7)
    assert plan.trees[1] is None


@pytest.mark.parametrize("slots, counts", [((0, 0), (1, 1)), ((0, 1), (2,)), ((0, 1), (0, 3)), ((0, 1), (1, 1))])
def test_counts_that_do_not_match_the_rows_are_refused(slots, counts):
    with pytest.raises(ValueError, match="distinct slots and a count >= 1"):
        plan_rows(_cache([0, 0]), slots, counts, 3, None, None, CPU)
