"""SlotLengths: the per-slot lengths and commits every cache kind shares, written once."""

from __future__ import annotations

import pytest

from specdecode.kv.cache import CacheConfig, KVCache
from specdecode.kv.compressed import CompressedCache
from specdecode.kv.slots import SlotLengths, check_compaction


class Recording(SlotLengths):
    """SlotLengths with storage that records what it is asked to do, and refuses to un-verify below ``frozen``."""

    def __init__(self, slots: int, frozen: int = 0) -> None:
        super().__init__(slots)
        self.frozen = frozen
        self.moves: list[tuple[int, int, list[int]]] = []
        self.uncommits: list[tuple[int, int]] = []

    def _check_uncommit(self, slot: int, length: int) -> None:
        self.uncommits.append((slot, length))
        if length < self.frozen:
            raise ValueError(f"tokens below {self.frozen} are compressed")

    def _move_rows(self, slot: int, start: int, rows) -> None:
        self.moves.append((slot, start, list(rows)))


def test_advance_commit_and_reset_per_slot():
    s = SlotLengths(3)
    assert s.lengths == [0, 0, 0] and s.committed == [0, 0, 0]
    s.advance([0, 2], 5)
    s.advance([2], 1)
    assert s.lengths == [5, 0, 6] and s.visible(2) == 6
    s.commit(1, 9)  # a prompt may be committed before it is written
    s.commit(1, 4)  # commit never lowers
    assert s.committed == [0, 9, 0]
    s.reset(1)
    assert s.lengths == [5, 0, 6] and s.committed == [0, 0, 0]


def test_trim_lowers_the_length_and_pulls_committed_down():
    s = Recording(2)
    s.advance([0], 10)
    s.commit(0, 6)
    s.trim(0, 8)  # unverified tokens only: nothing to ask the storage
    assert (s.lengths[0], s.committed[0], s.uncommits) == (8, 6, [])
    s.trim(0, 6)  # down to the committed length: still nothing un-verified
    assert (s.lengths[0], s.committed[0], s.uncommits) == (6, 6, [])
    s.trim(0, 5)  # one verified token rolled back
    assert (s.lengths[0], s.committed[0], s.uncommits) == (5, 5, [(0, 5)])
    s.trim(0, 3)
    assert (s.lengths[0], s.committed[0], s.uncommits) == (3, 3, [(0, 5), (0, 3)])
    s.trim(0, 3)  # to its own length: a no-op
    assert (s.lengths[0], s.committed[0]) == (3, 3)


@pytest.mark.parametrize("length", [-1, 11])
def test_trim_outside_the_held_length_is_refused_and_changes_nothing(length):
    s = Recording(1)
    s.advance([0], 10)
    s.commit(0, 10)
    with pytest.raises(ValueError, match=rf"cannot trim slot 0 of length 10 to {length}"):
        s.trim(0, length)
    assert (s.lengths, s.committed, s.uncommits) == ([10], [10], [])


def test_a_refused_uncommit_changes_nothing():
    s = Recording(1, frozen=5)
    s.advance([0], 10)
    s.commit(0, 10)
    with pytest.raises(ValueError, match="compressed"):
        s.trim(0, 4)
    assert (s.lengths, s.committed) == ([10], [10])
    s.trim(0, 5)
    assert (s.lengths, s.committed) == ([5], [5])


def test_compact_moves_rows_only_when_one_moves_and_sets_the_length():
    s = Recording(2)
    s.advance([1], 10)
    s.commit(1, 4)
    s.compact(1, 4, [0, 1, 2])  # the path already in place
    assert s.moves == [] and s.lengths[1] == 7
    s.compact(1, 4, [0, 2])
    assert s.moves == [(1, 4, [0, 2])] and s.lengths[1] == 6
    s.compact(1, 4, [])  # nothing kept past start
    assert s.lengths[1] == 4 and len(s.moves) == 1


@pytest.mark.parametrize("start, rows, message", [
    (3, [0], r"from position 3: tokens up to 4 are verified"),
    (4, [1, 1], r"increasing offsets"),
    (4, [2, 1], r"increasing offsets"),
    (4, [-1, 0], r"increasing offsets"),
    (4, [0, 6], r"slot 0 holds 6 past position 4"),
])
def test_compaction_checks(start, rows, message):
    s = Recording(1)
    s.advance([0], 10)
    s.commit(0, 4)
    with pytest.raises(ValueError, match=message):
        check_compaction(s, 0, start, rows)
    with pytest.raises(ValueError, match=message):
        s.compact(0, start, rows)
    assert s.lengths == [10] and s.moves == []


def test_the_base_has_no_entries_to_move():
    s = SlotLengths(1)
    s.advance([0], 3)
    s.compact(0, 0, [0, 1])  # nothing moves: fine
    with pytest.raises(NotImplementedError):
        s.compact(0, 0, [1])


@pytest.mark.parametrize("cache", [
    KVCache(2, 1, 4, CacheConfig(max_len=16, slots=2)),
    CompressedCache(2, 1, 4, CacheConfig(max_len=64, slots=2, kv_dtype="int8", group_size=4, residual=4,
                                         prefill_chunk=8, lookahead=8)),
], ids=["plain", "compressed"])
def test_every_cache_kind_keeps_its_lengths_here(cache):
    assert isinstance(cache, SlotLengths)
    # The bookkeeping is written once: no cache kind redefines it.
    for name in ("advance", "commit", "trim", "compact"):
        assert getattr(type(cache), name) is getattr(SlotLengths, name), name
    cache.advance([1], 6)
    cache.commit(1, 6)
    cache.trim(1, 2)
    assert (cache.lengths, cache.committed) == ([0, 2], [0, 2])
    cache.reset(1)
    assert (cache.lengths, cache.committed) == ([0, 0], [0, 0])
