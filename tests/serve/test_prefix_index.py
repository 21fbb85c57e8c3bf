"""PrefixIndex with no Ray: the longest shared prefix wins (ties kept), bounded memory, forgotten replicas."""

from __future__ import annotations

import os
import random

import pytest

from specdecode.serve.prefix_index import PrefixIndex, common_prefix_length


def test_the_longest_shared_prefix_wins_among_the_given_replicas():
    index = PrefixIndex()
    index.record("a", "You are a helpful assistant. Translate: hello")
    index.record("b", "You are a pirate. Say hi")
    assert index.best("You are a helpful assistant. Translate: bye", ["a", "b"]) == \
        (["a"], len("You are a helpful assistant. Translate: "))
    assert index.best("You are a pirate. Sing", ["a", "b"]) == (["b"], len("You are a pirate. S"))
    assert index.best("You are a helpful", ["b"])[0] == ["b"]  # only candidates count
    assert index.best("You are a", ["a", "b"]) == (["a", "b"], len("You are a"))  # a tie keeps both
    assert index.best("Zebra", ["a", "b"]) == ([], 0)
    assert index.best("anything", []) == ([], 0)


def test_memory_is_bounded_repeats_are_kept_once_and_forget_drops_a_replica():
    index = PrefixIndex(per_replica=2, max_chars=8)
    for text in ("first prompt", "second", "third"):
        index.record("a", text)
    assert index.best("first prompt", ["a"]) == ([], 0)  # the oldest text was dropped
    assert index.best("thirdXX", ["a"]) == (["a"], 5)
    assert index.best("second and more text", ["a"]) == (["a"], 6)
    index.record("a", "third")  # a repeat: "second" stays
    assert index.best("second", ["a"]) == (["a"], 6)
    index.record("a", "0123456789")
    assert index.best("0123456789", ["a"]) == (["a"], 8)  # texts are kept and matched to max_chars
    index.record("a", "")  # nothing to remember
    index.forget("a")
    assert index.best("third", ["a"]) == ([], 0)
    with pytest.raises(ValueError, match="per_replica"):
        PrefixIndex(per_replica=0)


def test_common_prefix_length_agrees_with_the_character_loop():
    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 12)))
        b = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 12)))
        assert common_prefix_length(a, b) == len(os.path.commonprefix((a, b))), (a, b)


def test_affine_keeps_the_prefix_within_the_load_bound():
    index = PrefixIndex()
    system = "You are a careful assistant for a travel agency. Answer briefly. "
    index.record("a", system + "Is the museum open?")
    index.record("b", "def quicksort(items):")
    ask = system + "Can I bring my dog?"
    assert index.affine(ask, {"a": 0, "b": 0}, 32, 2) == ["a"]
    assert index.affine(ask, {"a": 2, "b": 0}, 32, 2) == ["a"]  # at the bound
    assert index.affine(ask, {"a": 3, "b": 0}, 32, 2) == []  # beyond it: by load
    assert index.affine(ask, {"a": 0, "b": 0}, len(ask), 2) == []  # too short a match
    assert index.affine("def quick", {"a": 0, "b": 0}, 4, 2) == ["b"]
    index.record("b", system + "Where are my keys?")
    assert index.affine(ask, {"a": 1, "b": 0}, 32, 2) == ["a", "b"]  # a tie: Ray takes the shorter queue
