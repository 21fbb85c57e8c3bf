"""The depth-bounded suffix trie: counts against a brute-force count, removal, matching, continuations."""

from __future__ import annotations

import random

import pytest

from specdecode.drafters.suffix_tree import NODE_BYTES, ROOT, SuffixTrie
from specdecode.tree import check_tree


def _occurrences(seqs: list[list[int]], sub: list[int]) -> int:
    n = len(sub)
    return sum(seq[i:i + n] == sub for seq in seqs for i in range(len(seq) - n + 1))


def _substrings(seqs: list[list[int]], max_len: int) -> set[tuple[int, ...]]:
    return {tuple(seq[i:j]) for seq in seqs for i in range(len(seq))
            for j in range(i + 1, min(len(seq), i + max_len) + 1)}


def _grow(trie: SuffixTrie, seq: list[int]) -> list[int]:
    """Inserts ``seq`` a token at a time; returns its path."""
    path = [ROOT]
    for token in seq:
        path = trie.extend(path, token)
    return path


def _check_counts(trie: SuffixTrie, seqs: list[list[int]]) -> None:
    subs = _substrings(seqs, trie.max_depth)
    assert trie.nodes == len(subs) and trie.nbytes == len(subs) * NODE_BYTES  # one node per distinct substring
    assert trie.count([]) == sum(map(len, seqs))
    for sub in subs:
        assert trie.count(list(sub)) == _occurrences(seqs, list(sub)), sub


def _random_seqs(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(3) for _ in range(rng.randrange(1, 14))] for _ in range(n)]


@pytest.mark.parametrize("seed", range(20))
def test_counts_are_substring_occurrences_however_the_sequences_came_in(seed):
    rng = random.Random(seed)
    seqs = _random_seqs(rng, 4)
    trie = SuffixTrie(max_depth=rng.randrange(1, 6))
    for seq in seqs:
        trie.insert(seq) if rng.random() < 0.5 else _grow(trie, seq)
    _check_counts(trie, seqs)
    assert trie.count([5]) == 0 and trie.count(seqs[0] + [5]) == 0


@pytest.mark.parametrize("seed", range(20))
def test_removing_sequences_leaves_the_others_counts_and_frees_empty_nodes(seed):
    rng = random.Random(seed)
    seqs = _random_seqs(rng, 5)
    trie = SuffixTrie(max_depth=4)
    for seq in seqs:
        trie.insert(seq)
    for _ in range(3):
        trie.remove(seqs.pop(rng.randrange(len(seqs))))
        _check_counts(trie, seqs)
    allocated = len(trie.counts)
    trie.insert(seqs[0])  # freed nodes are reused before new ones are made
    assert len(trie.counts) == allocated
    for seq in [seqs[0], *seqs]:
        trie.remove(seq)
    assert trie.nodes == 0 and trie.count([]) == 0 and trie.children[ROOT] is None


def test_a_grown_sequences_path_is_its_tails():
    trie = SuffixTrie(max_depth=3)
    seq = [1, 2, 1, 2, 3]
    path = [ROOT]
    for n, token in enumerate(seq, 1):
        path = trie.extend(path, token)
        assert len(path) == min(n, 3) + 1 and path == trie.match(seq[:n])
    assert [trie.counts[node] for node in path] == [5, 1, 1, 1]  # "", 3, 2 3, 1 2 3


@pytest.mark.parametrize("seed", range(10))
def test_match_finds_the_longest_tail_that_occurred(seed):
    rng = random.Random(seed)
    seqs = _random_seqs(rng, 3)
    trie = SuffixTrie(max_depth=5)
    for seq in seqs:
        trie.insert(seq)
    query = [rng.randrange(4) for _ in range(8)]
    path = trie.match(query)
    longest = max(d for d in range(6) if d == 0 or _occurrences(seqs, query[-d:]))
    assert len(path) - 1 == longest
    assert [trie.counts[node] for node in path[1:]] == [_occurrences(seqs, query[-d:]) for d in range(1, longest + 1)]
    grown = [ROOT]  # advance, a token at a time, finds the same
    for token in query:
        grown = trie.advance(grown, token)
    assert grown == path


def test_a_chain_follows_the_most_frequent_child_with_path_probabilities():
    trie = SuffixTrie(max_depth=4)
    for seq in ([7, 1, 2], [7, 1, 2], [7, 1, 3], [7, 4, 5]):
        trie.insert(seq)
    node = trie.match([9, 7])[-1]
    tokens, probs = trie.chain(node, budget=5)
    assert tokens == [1, 2] and probs == pytest.approx([3 / 4, 3 / 4 * 2 / 3])
    assert trie.chain(node, budget=1) == ([1], [0.75])
    assert trie.chain(node, budget=5, min_prob=0.6)[0] == [1]  # 2 would fall to 0.5
    assert trie.chain(node, budget=5, base=3)[1] == pytest.approx([1.0, 2 / 3])  # one occurrence ends at 7
    assert trie.chain(trie.match([5])[-1], budget=5) == ([], [])


def test_a_chain_forgets_a_removed_favourite():
    trie = SuffixTrie(max_depth=2)
    for seq in ([1, 2], [1, 2], [1, 3]):
        trie.insert(seq)
    assert trie.chain(trie.match([1])[-1], 1)[0] == [2]
    trie.remove([1, 2])
    trie.remove([1, 2])
    assert trie.chain(trie.match([1])[-1], 1) == ([3], [1.0])
    trie.insert([1, 4])  # a tie: the latest seen
    assert trie.chain(trie.match([1])[-1], 1)[0] == [4]


@pytest.mark.parametrize("seed", range(10))
def test_every_chain_step_takes_a_most_frequent_child(seed):
    rng = random.Random(seed)
    seqs = _random_seqs(rng, 6)
    trie = SuffixTrie(max_depth=6)
    for seq in seqs:
        _grow(trie, seq)
    trie.remove(seqs.pop())
    tail = [rng.randrange(3)]
    tokens, probs = trie.chain(trie.match(tail)[-1], budget=5)
    prefix, prob = tail, 1.0
    for token, p in zip(tokens, probs):
        counts = {t: _occurrences(seqs, prefix + [t]) for t in range(3)}
        assert counts[token] == max(counts.values())
        prob *= counts[token] / _occurrences(seqs, prefix)
        assert p == pytest.approx(prob)
        prefix = prefix + [token]


def test_a_tree_expands_best_first_under_a_budget():
    trie = SuffixTrie(max_depth=4)
    for seq in ([7, 1, 2], [7, 1, 2], [7, 1, 3], [7, 4, 5], [7, 6]):
        trie.insert(seq)
    node = trie.match([7])[-1]
    tokens, parents, probs = trie.tree(node, budget=10)
    check_tree(tokens, parents)
    assert (tokens[:3], parents[:3]) == ([1, 2, 4], [-1, 0, -1])  # then three at 1/5, in any order
    assert {(t, tokens[p] if p >= 0 else None) for t, p in zip(tokens[3:], parents[3:])} == {(3, 1), (5, 4), (6, None)}
    assert probs == pytest.approx([3 / 5, 2 / 5, 1 / 5, 1 / 5, 1 / 5, 1 / 5])
    assert trie.tree(node, budget=3)[0] == [1, 2, 4]
    assert trie.tree(node, budget=10, min_prob=0.3)[:2] == ([1, 2], [-1, 0])
    assert trie.tree(node, budget=10, base=3)[2][0] == pytest.approx(1.0)


def test_depth_is_bounded():
    trie = SuffixTrie(max_depth=2)
    trie.insert([1, 2, 3, 4])
    assert trie.count([1, 2]) == 1 and trie.count([1, 2, 3]) == 0 and trie.nodes == 7
    assert trie.chain(trie.match([1, 2])[-1], 5) == ([], [])  # nothing below depth 2
    with pytest.raises(ValueError, match="max_depth >= 1"):
        SuffixTrie(max_depth=0)
