"""Prompt-lookup drafting."""

from __future__ import annotations

import random

import pytest
import torch

from specdecode.drafters import DrafterInputs, registry
from specdecode.drafters.ngram import NgramDrafter, find_match, lookup, match_signals
from specdecode.sampling import SamplingParams


def test_finds_the_latest_match():
    #      0  1  2  3  4  5  6  7  8
    seq = [5, 1, 2, 5, 3, 4, 5, 8, 5]
    assert lookup(seq, 2, 1, 1) == [8, 5]  # latest earlier 5 is at index 6
    assert lookup(seq[:-2], 2, 1, 1) == [3, 4]  # tail 5 at index 6; latest earlier at index 3


def test_prefers_longer_ngrams():
    #      0  1  2  3  4  5  6  7  8  9
    seq = [1, 2, 3, 9, 5, 3, 7, 1, 2, 3]
    assert lookup(seq, 4, 1, 3) == [9, 5, 3, 7]  # [1, 2, 3] matches at 0
    assert lookup(seq, 4, 1, 1) == [7, 1, 2, 3]  # only [3]: its latest earlier match is at 5
    assert lookup(seq, 4, 1, 2) == [9, 5, 3, 7]  # [2, 3] matches at 1


def test_no_match_gives_empty():
    assert lookup([1, 2, 3, 4], 4, 1, 3) == []
    assert lookup([7], 4, 1, 3) == []
    assert lookup([], 4, 1, 3) == []


def test_caps_at_k():
    seq = [1, 2, 3, 4, 5, 6, 1]
    assert lookup(seq, 3, 1, 2) == [2, 3, 4]
    assert lookup(seq, 0, 1, 2) == []


def test_a_continuation_reaching_the_end_repeats_the_period():
    # The latest earlier 5 is two tokens back, so the text is read as repeating "8, 5".
    assert lookup([5, 1, 2, 5, 3, 4, 5, 8, 5], 5, 1, 1) == [8, 5, 8, 5, 8]
    assert lookup([1, 2, 3, 4, 5, 6, 1], 9, 1, 2) == [2, 3, 4, 5, 6, 1, 2, 3, 4]
    assert lookup([4, 4], 5, 1, 3) == [4, 4, 4, 4, 4]


def test_respects_min_and_max_sizes():
    #      0  1  2  3  4  5  6
    seq = [8, 1, 2, 6, 0, 9, 2]
    assert lookup(seq, 2, 1, 3) == [6, 0]  # only a 1-gram ([2]) matches
    assert lookup(seq, 2, 2, 3) == []  # 1-grams are below min_ngram
    long = [1, 2, 3, 4, 0, 3, 4, 1, 2, 3, 4]
    assert lookup(long, 2, 1, 4) == [0, 3]  # the 4-gram at 0
    assert lookup(long, 2, 1, 2) == [1, 2]  # [3, 4]: latest earlier match at 5


def test_drafter_proposes_lookup_with_one_hot_q_whatever_the_temperature():
    seq = [1, 2, 3, 9, 5, 3, 7, 1, 2, 3]
    drafter = NgramDrafter(max_ngram=3, min_ngram=2)
    g = torch.Generator().manual_seed(0)
    for params in (SamplingParams(), SamplingParams(temperature=1.5, top_k=3)):
        draft = drafter.propose(seq, 3, params, g)
        assert draft.tokens == [9, 5, 3] and draft.q is None
    assert drafter.name == "ngram"


@pytest.mark.parametrize("min_ngram, max_ngram", [(0, 3), (3, 2), (-1, -1)])
def test_size_validation(min_ngram, max_ngram):
    with pytest.raises(ValueError, match=f"1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}"):
        NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)


def test_the_registry_builds_it_with_the_sizes_given_else_its_own():
    d = registry.build("ngram", DrafterInputs(target=None, ngram_sizes=(2, 4)))
    assert isinstance(d, NgramDrafter) and (d.min_ngram, d.max_ngram) == (2, 4)
    d = registry.build("ngram", DrafterInputs(target=None))
    assert (d.min_ngram, d.max_ngram) == (NgramDrafter.min_ngram, NgramDrafter.max_ngram)
    with pytest.raises(ValueError, match="unknown drafter 'bogus'"):
        registry.build("bogus", DrafterInputs(target=None))
    with pytest.raises(ValueError, match="unknown drafter 'none'"):  # plain decoding is no drafter
        registry.build("none", DrafterInputs(target=None))


def test_signals_give_match_length_occurrences_and_agreement():
    #      0  1  2  3  4  5  6  7  8  9 10 11
    seq = [1, 2, 5, 6, 9, 1, 2, 5, 7, 3, 1, 2]
    # Tail [1, 2] occurred at 5 (then 5, 7, 3) and at 0 (then 5, 6, 9): they agree on the first token only.
    n, starts = find_match(seq, 1, 3, limit=16)
    assert (n, starts) == (2, [5, 0])
    assert match_signals(seq, [5, 7, 3], n, starts) == [(2.0, 2.0, 1.0), (2.0, 2.0, 0.5), (2.0, 2.0, 0.5)]
    calls = []
    draft = NgramDrafter().propose(seq, 3, SamplingParams(), None, stop=lambda i, s: calls.append(i) or s[2] < 1.0)
    assert draft.tokens == [5, 7] and draft.signals == [(2.0, 2.0, 1.0), (2.0, 2.0, 0.5)] and calls == [0, 1]
    assert NgramDrafter().propose(seq, 3, SamplingParams(), None).signals == []
    assert NgramDrafter().propose([1, 2, 3], 3, SamplingParams(), None, stop=lambda i, s: False).tokens == []


def _find_match_by_slices(seq: list[int], min_ngram: int, max_ngram: int, limit: int) -> tuple[int, list[int]]:
    """find_match's definition, one slice per start and tail length (what it computed before the index pass)."""
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        starts = [s for s in range(len(seq) - n - 1, -1, -1) if seq[s:s + n] == seq[-n:]][:limit]
        if starts:
            return n, starts
    return 0, []


def test_find_match_agrees_with_the_slice_by_slice_definition():
    rng = random.Random(0)
    for _ in range(2000):
        vocab = rng.choice([2, 3, 5, 50])  # small vocabularies: many overlapping, partial and full matches
        seq = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
        for min_ngram, max_ngram in [(1, 3), (2, 4), (1, 1), (3, 5)]:
            for limit in (1, 2, 16):
                assert find_match(seq, min_ngram, max_ngram, limit) == \
                    _find_match_by_slices(seq, min_ngram, max_ngram, limit), (seq, min_ngram, max_ngram, limit)
