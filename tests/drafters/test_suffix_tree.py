"""The depth-bounded suffix trie, both implementations (Python and compiled): counts against a brute-force count,
removal, matching, continuations, and the two giving the same answers to the same random operations."""

from __future__ import annotations

import math
import random

import pytest

from specdecode.drafters.suffix_tree import ROOT, SuffixTrie, native_trie, new_trie
from specdecode.tree import check_tree


def _compiled(max_depth: int = 32):
    module = native_trie()
    if module is None:
        pytest.skip("the compiled suffix trie does not build here (no C++ compiler or ninja)")
    return module.SuffixTrie(max_depth)


@pytest.fixture(params=["python", "compiled"])
def make(request):
    """Makes an empty trie of the implementation under test."""
    return SuffixTrie if request.param == "python" else _compiled


def _occurrences(seqs: list[list[int]], sub: list[int]) -> int:
    n = len(sub)
    return sum(seq[i:i + n] == sub for seq in seqs for i in range(len(seq) - n + 1))


def _substrings(seqs: list[list[int]], max_len: int) -> set[tuple[int, ...]]:
    return {tuple(seq[i:j]) for seq in seqs for i in range(len(seq))
            for j in range(i + 1, min(len(seq), i + max_len) + 1)}


def _grow(trie, seq: list[int]) -> list[int]:
    """Inserts ``seq`` a token at a time; returns its path."""
    path = [ROOT]
    for token in seq:
        path = trie.extend(path, token)
    return path


def _check_counts(trie, seqs: list[list[int]]) -> None:
    subs = _substrings(seqs, trie.max_depth)
    assert trie.nodes == len(subs) and trie.nbytes == len(subs) * trie.node_bytes  # one node per distinct substring
    assert trie.count([]) == sum(map(len, seqs))
    for sub in subs:
        assert trie.count(list(sub)) == _occurrences(seqs, list(sub)), sub


def _random_seqs(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(3) for _ in range(rng.randrange(1, 14))] for _ in range(n)]


@pytest.mark.parametrize("seed", range(20))
def test_counts_are_substring_occurrences_however_the_sequences_came_in(make, seed):
    rng = random.Random(seed)
    seqs = _random_seqs(rng, 4)
    trie = make(max_depth=rng.randrange(1, 6))
    for seq in seqs:
        trie.insert(seq) if rng.random() < 0.5 else _grow(trie, seq)
    _check_counts(trie, seqs)
    assert trie.count([5]) == 0 and trie.count(seqs[0] + [5]) == 0


@pytest.mark.parametrize("seed", range(20))
def test_removing_sequences_leaves_the_others_counts_and_frees_empty_nodes(make, seed):
    rng = random.Random(seed)
    seqs = _random_seqs(rng, 5)
    trie = make(max_depth=4)
    for seq in seqs:
        trie.insert(seq)
    for _ in range(3):
        trie.remove(seqs.pop(rng.randrange(len(seqs))))
        _check_counts(trie, seqs)
    allocated = trie.allocated
    trie.insert(seqs[0])  # freed nodes are reused before new ones are made
    assert trie.allocated == allocated
    for seq in [seqs[0], *seqs]:
        trie.remove(seq)
    assert trie.nodes == 0 and trie.count([]) == 0 and not trie.has_children(ROOT)


def test_a_grown_sequences_path_is_its_tails(make):
    trie = make(max_depth=3)
    seq = [1, 2, 1, 2, 3]
    path = [ROOT]
    for n, token in enumerate(seq, 1):
        path = trie.extend(path, token)
        assert len(path) == min(n, 3) + 1 and path == trie.match(seq[:n])
    assert trie.counts_along(path) == [5, 1, 1, 1]  # "", 3, 2 3, 1 2 3


@pytest.mark.parametrize("seed", range(10))
def test_match_finds_the_longest_tail_that_occurred(make, seed):
    rng = random.Random(seed)
    seqs = _random_seqs(rng, 3)
    trie = make(max_depth=5)
    for seq in seqs:
        trie.insert(seq)
    query = [rng.randrange(4) for _ in range(8)]
    path = trie.match(query)
    longest = max(d for d in range(6) if d == 0 or _occurrences(seqs, query[-d:]))
    assert len(path) - 1 == longest
    assert trie.counts_along(path[1:]) == [_occurrences(seqs, query[-d:]) for d in range(1, longest + 1)]
    grown = [ROOT]  # advance, a token at a time, finds the same
    for token in query:
        grown = trie.advance(grown, token)
    assert grown == path


def test_a_chain_follows_the_most_frequent_child_with_path_probabilities(make):
    trie = make(max_depth=4)
    for seq in ([7, 1, 2], [7, 1, 2], [7, 1, 3], [7, 4, 5]):
        trie.insert(seq)
    node = trie.match([9, 7])[-1]
    tokens, probs = trie.chain(node, budget=5)
    assert tokens == [1, 2] and probs == pytest.approx([3 / 4, 3 / 4 * 2 / 3])
    assert trie.chain(node, budget=1) == ([1], [0.75])
    assert trie.chain(node, budget=5, min_prob=0.6)[0] == [1]  # 2 would fall to 0.5
    assert trie.chain(node, budget=5, base=3)[1] == pytest.approx([1.0, 2 / 3])  # one occurrence ends at 7
    assert trie.chain(trie.match([5])[-1], budget=5) == ([], [])


def test_a_chain_forgets_a_removed_favourite(make):
    trie = make(max_depth=2)
    for seq in ([1, 2], [1, 2], [1, 3]):
        trie.insert(seq)
    assert trie.chain(trie.match([1])[-1], 1)[0] == [2]
    trie.remove([1, 2])
    trie.remove([1, 2])
    assert trie.chain(trie.match([1])[-1], 1) == ([3], [1.0])
    trie.insert([1, 4])  # a tie: the latest seen
    assert trie.chain(trie.match([1])[-1], 1)[0] == [4]


@pytest.mark.parametrize("seed", range(10))
def test_every_chain_step_takes_a_most_frequent_child(make, seed):
    rng = random.Random(seed)
    seqs = _random_seqs(rng, 6)
    trie = make(max_depth=6)
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


def test_a_tree_expands_best_first_under_a_budget(make):
    trie = make(max_depth=4)
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


def test_depth_is_bounded(make):
    trie = make(max_depth=2)
    trie.insert([1, 2, 3, 4])
    assert trie.count([1, 2]) == 1 and trie.count([1, 2, 3]) == 0 and trie.nodes == 7
    assert trie.chain(trie.match([1, 2])[-1], 5) == ([], [])  # nothing below depth 2
    with pytest.raises(ValueError, match="max_depth >= 1"):
        make(max_depth=0)
    assert new_trie(3).max_depth == 3


@pytest.mark.parametrize("seed", range(30))
def test_the_compiled_trie_answers_as_the_python_one(seed):
    """Random inserts, token-at-a-time growth and removals on both: every path, count, chain and tree the same,
    ties and reused node ids included."""
    rng = random.Random(seed)
    depth = rng.randrange(1, 7)
    python, compiled = SuffixTrie(depth), _compiled(depth)
    kept: list[list[int]] = []
    for _ in range(12):
        if kept and rng.random() < 0.3:
            seq = kept.pop(rng.randrange(len(kept)))
            python.remove(seq)
            compiled.remove(seq)
        else:
            seq = [rng.randrange(rng.choice([3, 40])) for _ in range(rng.randrange(1, 30))]
            if rng.random() < 0.5:
                python.insert(seq)
                compiled.insert(seq)
            elif rng.random() < 0.5:
                assert _grow(python, seq) == _grow(compiled, seq)
            else:  # the path of a sequence grown in pieces
                cut = rng.randrange(len(seq) + 1)
                paths = [t.extend_all(t.extend_all([ROOT], seq[:cut]), seq[cut:]) for t in (python, compiled)]
                assert paths[0] == paths[1] == python.match(seq)[:len(paths[0])]
            kept.append(seq)
        assert (python.nodes, python.allocated) == (compiled.nodes, compiled.allocated)
        for _ in range(5):
            query = [rng.randrange(40) for _ in range(rng.randrange(0, 8))]
            path = python.match(query)
            assert compiled.match(query) == path and compiled.counts_along(path) == python.counts_along(path)
            for more_than in range(4):
                deepest = python.deepest(path, more_than)
                assert compiled.deepest(path, more_than) == deepest
                assert deepest == max((d for d, c in enumerate(python.counts_along(path)) if c > more_than), default=-1)
            assert compiled.count(query[-3:]) == python.count(query[-3:])
            for node in path:
                budget, min_prob = rng.randrange(1, 9), rng.choice([0.0, 0.2])
                base = rng.choice([None, python.node_count(node) + 1])
                assert compiled.chain(node, budget, min_prob, base) == python.chain(node, budget, min_prob, base)
                assert compiled.tree(node, budget, min_prob, base) == python.tree(node, budget, min_prob, base)
            for tree in (False, True):
                args = (path, rng.randrange(2), rng.randrange(1, 9), rng.randrange(1, 4), rng.choice([0.5, 1.0, 2.0]),
                        rng.choice([0.0, 0.2]), tree, rng.choice([-math.inf, 0.5, 1.5]))
                assert compiled.pick(*args) == python.pick(*args)


@pytest.mark.parametrize("seed", range(10))
def test_pick_is_the_top_scoring_tail_of_all_longest_first(make, seed):
    """``pick`` skips tails that cannot score more; it must still find what scoring every tail finds: the highest sum
    of path probabilities, the longer tail on ties, and nothing unless it beats the floor."""
    rng = random.Random(seed)
    trie = make(6)
    for seq in _random_seqs(rng, 5):
        trie.insert(seq)
    for _ in range(10):
        path = _grow(trie, [rng.randrange(3) for _ in range(rng.randrange(1, 8))])  # (the sequence's own: own = 1)
        budget, shortest, alpha, floor = rng.randrange(1, 6), rng.randrange(1, 3), rng.choice([0.5, 1.0]), \
            rng.choice([-math.inf, 0.9])
        scored = []
        for d in range(shortest, len(path)):
            count = trie.node_count(path[d]) - 1
            room = min(budget, math.ceil(alpha * d), trie.max_depth - d)
            if count >= 1 and room >= 1:
                tokens, probs = trie.chain(path[d], room, 0.0, count)
                scored.append((sum(probs), d, tokens, probs, count))
        top = max(scored, key=lambda s: s[:2], default=None)
        found = trie.pick(path, 1, budget, shortest, alpha, 0.0, False, floor)
        if top is None or top[0] <= floor:
            assert found is None
        else:
            assert found == (top[2], [], top[3], top[1], top[4], pytest.approx(top[0]))


def test_where_nothing_compiles_tries_are_the_python_class_and_the_log_says_why(monkeypatch):
    from specdecode.drafters import suffix_tree

    monkeypatch.setattr(suffix_tree, "_native", [])
    monkeypatch.setattr(suffix_tree, "compile_extension", lambda *a, **k: (None, "no C++ compiler on PATH"))
    lines: list[str] = []
    assert suffix_tree.native_trie(lines.append) is None
    assert lines[-1] == "suffix tries stay in Python (slower): no C++ compiler on PATH"
    assert type(new_trie(4)) is SuffixTrie


def test_a_node_with_many_children_is_found_alike_as_they_come_and_go(make):
    # The compiled trie looks children up by walking a node's links up to 8 children and in a table past that:
    # crossing the bound both ways, each child stays where it was, in the order it came.
    trie = make(max_depth=2)
    for token in range(12):
        trie.insert([7, token])
    node = trie.match([7])[-1]
    assert [trie.count([7, t]) for t in range(12)] == [1] * 12
    for token in range(11):
        trie.remove([7, token])
        assert [trie.count([7, t]) for t in range(12)] == [0] * (token + 1) + [1] * (11 - token)
        assert sorted(trie.tree(node, budget=20)[0]) == list(range(token + 1, 12))
    trie.insert([7, 3])  # a tie with 11: the latest seen is the chain's pick
    assert trie.chain(node, budget=1)[0] == [3] and sorted(trie.tree(node, budget=20)[0]) == [3, 11]


def test_the_compiled_trie_refuses_a_path_naming_no_node_and_changes_nothing():
    # (Python's lists raise on their own; the compiled trie would read past its arrays.)
    trie = _compiled(max_depth=4)
    trie.insert([1, 2, 3])
    with pytest.raises(IndexError):
        trie.extend([ROOT, 99], 5)
    assert trie.count([]) == 3 and trie.count([5]) == 0
    for continuations in (trie.chain, trie.tree):
        with pytest.raises(IndexError):
            continuations(99, 3, 0.0, 5)


def test_a_continuation_divided_by_no_occurrences_is_refused_alike(make):
    trie = make(max_depth=4)
    trie.insert([1, 2, 3])
    node = trie.match([1])[-1]
    for continuations in (trie.chain, trie.tree):
        with pytest.raises(ZeroDivisionError):
            continuations(node, 3, 0.0, 0)
