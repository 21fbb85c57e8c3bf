"""The radix-tree prefix cache without a model: hits, misses, block rounding, splits, reference counts,
LRU eviction and the byte allowance."""

from __future__ import annotations

import pytest
import torch

from specdecode.kv.prefix import PrefixCache

LAYERS, HEADS, DIM = 2, 2, 3
TOKEN_BYTES = LAYERS * 2 * HEADS * DIM * 4  # keys + values of one token, float32


def _kv(tokens, start: int = 0):
    """Per-layer K/V whose entries name their token and position, so any mix-up shows."""
    ids = torch.tensor([float(t * 1000 + start + i) for i, t in enumerate(tokens)])
    return [(ids[None, :, None].expand(HEADS, -1, DIM) + layer, -ids[None, :, None].expand(HEADS, -1, DIM) - layer)
            for layer in range(LAYERS)]


def _store(tree: PrefixCache, tokens) -> int:
    hit = tree.match(tokens)
    try:
        return tree.insert(tokens, _kv(tokens[hit.length:], hit.length), hit)
    finally:
        tree.release(hit)


def _check_kv(tree: PrefixCache, hit, tokens) -> None:
    want = _kv(tokens[:hit.length])
    got = tree.kv(hit)
    assert len(got) == LAYERS
    for (gk, gv), (wk, wv) in zip(got, want):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


def test_empty_tree_misses():
    tree = PrefixCache(block=2)
    hit = tree.match([1, 2, 3])
    assert hit.length == 0 and hit.nodes == [] and tree.kv(hit) == []
    tree.release(hit)
    assert tree.nbytes == 0 and tree.tokens == 0


def test_hit_is_the_longest_stored_prefix_in_whole_blocks():
    tree = PrefixCache(block=2)
    stored = [5, 6, 7, 8, 9, 10]
    assert _store(tree, stored) == 6
    assert tree.nbytes == 6 * TOKEN_BYTES and tree.tokens == 6
    cases = {
        (5, 6, 7, 8, 9, 10, 11): 6,  # the whole stored prefix
        (5, 6, 7, 8, 9, 99): 4,  # matches 5 tokens: rounded down to 2 blocks
        (5, 6, 7): 2,  # a prompt shorter than what is stored
        (5, 99): 0,  # one matching token is less than a block
        (6, 5): 0,  # miss
    }
    for prompt, length in cases.items():
        hit = tree.match(list(prompt))
        assert hit.length == length, prompt
        if length:
            _check_kv(tree, hit, list(prompt))
        tree.release(hit)
    assert tree.referenced == 0


def test_diverging_prompts_split_an_edge_and_share_the_common_part():
    tree = PrefixCache(block=2)
    a = [1, 2, 3, 4, 5, 6]
    b = [1, 2, 3, 4, 70, 80, 90, 91]
    _store(tree, a)
    hit = tree.match(b)
    assert hit.length == 4
    assert tree.insert(b, _kv(b[4:], 4), hit) == 4  # only the new tail is stored
    tree.release(hit)
    assert tree.tokens == 6 + 4 and tree.nbytes == 10 * TOKEN_BYTES
    root_edge = tree.root.children[1]
    assert root_edge.tokens == (1, 2, 3, 4) and set(root_edge.children) == {5, 70}
    for prompt in (a, b):
        hit = tree.match(prompt)
        assert hit.length == len(prompt)
        _check_kv(tree, hit, prompt)
        tree.release(hit)
    # Storing a prompt that is already there adds nothing.
    assert _store(tree, a) == 0 and tree.tokens == 10


def test_a_split_inside_a_hits_node_keeps_the_hit_valid():
    tree = PrefixCache(block=2)
    _store(tree, [1, 2, 3, 4, 5, 6])
    prompt = [1, 2, 3, 4, 5, 99, 7, 8]
    hit = tree.match(prompt)  # 5 tokens match: the hit uses 4 of the node's 6
    assert hit.length == 4 and len(hit.nodes) == 1
    tree.insert(prompt, _kv(prompt[4:], 4), hit)  # splits that node after token 5
    _check_kv(tree, hit, prompt)
    tree.release(hit)
    assert tree.referenced == 0
    assert tree.tokens == 6 + 3


def test_reference_counts_follow_matches_and_return_to_zero():
    tree = PrefixCache(block=2)
    _store(tree, [1, 2, 3, 4])
    first, second = tree.match([1, 2, 3, 4]), tree.match([1, 2, 9])
    assert tree.referenced == 2
    assert [n.refs for n in first.nodes] == [2]
    tree.release(first)
    tree.release(second)
    assert tree.referenced == 0
    with pytest.raises(RuntimeError, match="released twice"):
        tree.release(type(first)(2, [tree.root.children[1]]))


def test_lru_eviction_of_unreferenced_leaves_within_the_allowance():
    room = {"bytes": None}
    tree = PrefixCache(block=2, room=lambda: room["bytes"])
    for prompt in ([1, 1], [2, 2], [3, 3]):
        _store(tree, prompt)
    tree.release(tree.match([1, 1]))  # [1, 1] is now more recently used than [2, 2]
    room["bytes"] = 3 * 2 * TOKEN_BYTES
    _store(tree, [4, 4])  # needs one entry's room: the least recently used one goes
    assert sorted(tree.root.children) == [1, 3, 4]
    # A referenced entry is never evicted, even if it is the oldest.
    held = tree.match([3, 3])
    for prompt in ([5, 5], [6, 6]):
        _store(tree, prompt)
    assert 3 in tree.root.children and sorted(tree.root.children) == [3, 5, 6]
    tree.release(held)
    assert tree.nbytes == 3 * 2 * TOKEN_BYTES


def test_only_leaves_are_evicted_and_a_parent_goes_once_its_children_are_gone():
    tree = PrefixCache(block=2)
    _store(tree, [1, 2, 3, 4])
    _store(tree, [1, 2, 5, 6])
    assert tree.evict(2 * TOKEN_BYTES) == 2 * TOKEN_BYTES  # one leaf
    assert tree.tokens == 4
    assert tree.evict(10 ** 9) == 4 * TOKEN_BYTES  # the other leaf, then their parent
    assert tree.tokens == 0 and tree.nbytes == 0 and tree.root.children == {}
    assert tree.evict(1) == 0


def test_an_insert_larger_than_the_allowance_stores_the_blocks_that_fit():
    tree = PrefixCache(block=2, room=lambda: 5 * TOKEN_BYTES)
    assert _store(tree, [1, 2, 3, 4, 5, 6, 7, 8]) == 4  # 2 whole blocks
    assert tree.nbytes == 4 * TOKEN_BYTES
    assert _store(tree, [9, 9, 9, 9]) == 4  # evicts the first entry to make room
    assert sorted(tree.root.children) == [9]
    nothing = PrefixCache(block=2, room=lambda: TOKEN_BYTES)
    assert _store(nothing, [1, 2]) == 0 and nothing.nbytes == 0


def test_bad_inserts_are_refused():
    tree = PrefixCache(block=4)
    hit = tree.match([1, 2, 3])
    with pytest.raises(ValueError, match="whole blocks of 4 tokens, got 3"):
        tree.insert([1, 2, 3], _kv([1, 2, 3]), hit)
    _store(tree, [1, 2, 3, 4])
    stale = tree.match([1, 2, 3, 4])
    tree.evict(10 ** 9)  # referenced: not evicted
    assert tree.tokens == 4
    tree.release(stale)
    with pytest.raises(ValueError, match="PrefixCache.block must be >= 1, got 0"):
        PrefixCache(block=0)
