"""Per-slot length bookkeeping that every KV cache kind shares: ``lengths``, ``committed`` and the rules for
moving them (advance, commit, trim, reset, compact).

``lengths[s]`` is the number of tokens slot s holds logically (the position of its next token);
``committed[s]`` is how many of them the engine has declared verified (it may run ahead of ``lengths`` while
a prompt is being written). The rules, in one place:

* ``advance`` adds to a length; ``commit`` only ever raises ``committed``.
* ``trim`` lowers a length within ``[0, lengths[s]]`` and pulls ``committed`` down with it; a cache that has
  already compressed verified tokens refuses through ``_check_uncommit``.
* ``reset`` zeroes both.
* ``compact`` checks the kept rows (``check_compaction``), lets the cache move its entries
  (``_move_rows``, only when some row moves) and sets the length to ``start + len(rows)``.

This module holds no keys or values: it does not write, compress, evict or move entries (subclasses do, see
``cache.py`` and ``compressed.py``), it does not know a cache's ``max_len`` or check writes against it, and it
does not check a slot index against the number of slots beyond what list indexing does.
"""

from __future__ import annotations

from typing import Sequence


def check_compaction(cache: SlotLengths, slot: int, start: int, rows: Sequence[int]) -> None:
    """Raises ValueError unless ``rows`` can be kept by ``compact``: increasing offsets of tokens the slot
    holds past ``start``, none of them verified (verified tokens may already be compressed or shared)."""
    length = cache.lengths[slot]
    if start < cache.committed[slot]:
        raise ValueError(f"cannot compact slot {slot} from position {start}: tokens up to {cache.committed[slot]} are "
                         "verified (only unverified rows move)")
    if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and (rows[0] < 0 or start + rows[-1] >= length)):
        raise ValueError(f"compact needs increasing offsets of held tokens (slot {slot} holds {length - start} past "
                         f"position {start}), got {list(rows)}")


class SlotLengths:
    """The lengths and committed lengths of ``slots`` sequences, and the checks on changing them.

    A cache kind subclasses it and adds its storage: it implements ``_move_rows`` (for ``compact``) and, when
    it compresses verified tokens, ``_check_uncommit`` (for ``trim``); it extends ``reset`` to clear its own
    per-slot state.

    Args:
        slots: sequences held at once.
    """

    def __init__(self, slots: int) -> None:
        # Python ints, so that reading a length never synchronises with a device.
        self.lengths: list[int] = [0] * slots
        self.committed: list[int] = [0] * slots

    def visible(self, slot: int) -> int:
        """Entries a cache returns before a slot's new tokens: its length, where nothing is evicted."""
        return self.lengths[slot]

    def advance(self, slots: Sequence[int], n: int) -> None:
        """Marks ``n`` more tokens as held in each slot (called once per forward, after all layers)."""
        for s in slots:
            self.lengths[s] += n

    def commit(self, slot: int, length: int) -> None:
        """Declares the slot's tokens below ``length`` verified; never lowers what was committed before."""
        self.committed[slot] = max(self.committed[slot], length)

    def trim(self, slot: int, length: int) -> None:
        """Rolls a slot back to ``length`` tokens, at most its current length; committed tokens past it are
        un-verified, after ``_check_uncommit`` allowed it.

        Raises:
            ValueError: ``length`` is outside ``[0, lengths[slot]]``, or the cache can no longer roll back
                verified tokens to it.
        """
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot trim slot {slot} of length {self.lengths[slot]} to {length}")
        if length < self.committed[slot]:
            self._check_uncommit(slot, length)
            self.committed[slot] = length
        self.lengths[slot] = length

    def _check_uncommit(self, slot: int, length: int) -> None:
        """Raises ValueError where verified tokens from ``length`` on can no longer be rolled back (a compressing
        cache has quantized or evicted them); here nothing is compressed, so it never raises."""

    def reset(self, slot: int) -> None:
        """Frees a slot for a new sequence: no tokens held, none verified."""
        self.lengths[slot] = 0
        self.committed[slot] = 0

    def compact(self, slot: int, start: int, rows: Sequence[int]) -> None:
        """Keeps the unverified tokens at positions ``start + rows[j]`` as ``start + j`` and drops the rest
        after ``start``: checks ``rows`` (:func:`check_compaction`), has ``_move_rows`` move the entries
        unless every row stays where it is, and sets the slot's length to ``start + len(rows)``."""
        check_compaction(self, slot, start, rows)
        if any(r != j for j, r in enumerate(rows)):
            self._move_rows(slot, start, rows)
        self.lengths[slot] = start + len(rows)

    def _move_rows(self, slot: int, start: int, rows: Sequence[int]) -> None:
        """Moves the stored entries of positions ``start + rows[j]`` to ``start + j`` (``rows`` already checked,
        at least one row moves)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no entries to move")
