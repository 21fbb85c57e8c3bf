"""PrefixIndex with no Ray: the longest shared prefix wins, bounded memory, forgotten replicas."""

from __future__ import annotations

import pytest

from specdecode.serve.prefix_index import PrefixIndex


def test_the_longest_shared_prefix_wins_among_the_given_replicas():
    index = PrefixIndex()
    index.record("a", "You are a helpful assistant. Translate: hello")
    index.record("b", "You are a pirate. Say hi")
    assert index.best("You are a helpful assistant. Translate: bye", ["a", "b"]) == \
        ("a", len("You are a helpful assistant. Translate: "))
    assert index.best("You are a pirate. Sing", ["a", "b"]) == ("b", len("You are a pirate. S"))
    assert index.best("You are a helpful", ["b"])[0] == "b"  # only candidates count
    assert index.best("Zebra", ["a", "b"]) == (None, 0)
    assert index.best("anything", []) == (None, 0)


def test_memory_is_bounded_and_forget_drops_a_replica():
    index = PrefixIndex(per_replica=2, max_chars=8)
    for text in ("first prompt", "second", "third"):
        index.record("a", text)
    assert index.best("first prompt", ["a"]) == (None, 0)  # the oldest text was dropped
    assert index.best("thirdXX", ["a"]) == ("a", 5)
    assert index.best("second and more text", ["a"]) == ("a", 6)
    assert index.best("second", ["a"]) == ("a", 6)
    index.record("a", "0123456789")
    assert index.best("0123456789", ["a"]) == ("a", 8)  # texts are kept and matched to max_chars
    index.record("a", "")  # nothing to remember
    index.forget("a")
    assert index.best("third", ["a"]) == (None, 0)
    with pytest.raises(ValueError, match="per_replica"):
        PrefixIndex(per_replica=0)
