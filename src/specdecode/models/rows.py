"""The rows of a forward: which of them get logits (:class:`LogitRows`), what a forward hands back
(:class:`ForwardOutput`), and where each new row of a ragged multi-sequence forward sits (:class:`RowPlan`).

This module does not run layers (``backends/``) or hold the model (``transformer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, Sequence

import torch

from specdecode import tree
from specdecode.kv.cache import Cache


class _Choice(Enum):
    ALL = "all"
    LAST = "last"
    NONE = "none"
    INDEX = "index"


@dataclass(frozen=True, eq=False)
class LogitRows:
    """Which new rows of a forward get logits: ``LogitRows.ALL``, each sequence's last row (``LogitRows.LAST``),
    none (``LogitRows.NONE``: a prefill), or the rows at given indices (``LogitRows.at(index)``, ragged
    forwards only: a batch step scores its decoding rows, not its prompt rows)."""

    choice: _Choice
    index: torch.Tensor | None = None  # [K] row indices, with INDEX only

    ALL: ClassVar[LogitRows]
    LAST: ClassVar[LogitRows]
    NONE: ClassVar[LogitRows]

    @classmethod
    def at(cls, index: torch.Tensor) -> LogitRows:
        """The rows ``index`` (``[K]`` integer row indices of the forward's N rows), in that order."""
        if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"LogitRows.at needs a 1-D integer tensor of row indices, got {index.dtype} "
                             f"of shape {tuple(index.shape)}")
        return cls(_Choice.INDEX, index)

    @property
    def wanted(self) -> bool:
        """Whether any row gets logits."""
        return self.choice is not _Choice.NONE

    @property
    def last(self) -> bool:
        """Whether only each sequence's last row gets logits."""
        return self.choice is _Choice.LAST

    def of_rows(self, counts: Sequence[int], device: torch.device) -> slice | torch.Tensor:
        """The scored rows of a ragged forward whose sequences have ``counts`` rows each (NONE: none needed)."""
        if self.choice is _Choice.INDEX:
            return self.index.to(device)
        if self.choice is _Choice.LAST:
            return (torch.tensor(counts).cumsum(0) - 1).to(device)  # each sequence's last row
        return slice(None)

    def of_positions(self) -> slice:
        """The scored positions of each row of a batched ``[B, T]`` forward.

        Raises:
            ValueError: for ``LogitRows.at``, which names rows of a ragged forward.
        """
        if self.choice is _Choice.INDEX:
            raise ValueError("LogitRows.at names rows of a ragged forward (forward_rows); a batched forward scores "
                             "ALL, LAST or NONE")
        return slice(-1, None) if self.choice is _Choice.LAST else slice(None)


LogitRows.ALL = LogitRows(_Choice.ALL)
LogitRows.LAST = LogitRows(_Choice.LAST)
LogitRows.NONE = LogitRows(_Choice.NONE)


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    """What a forward hands back.

    Args:
        logits: float32 logits of the scored rows (see :class:`LogitRows`), or None when none was asked for.
        features: the asked layers' outputs side by side for every new row (``features=`` of the forward,
            in the model dtype), or None when none was asked for.
    """

    logits: torch.Tensor | None
    features: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class RowPlan:
    """Where the N new rows of a ragged forward sit: ``counts[i]`` consecutive rows continue the sequence in
    cache slot ``slots[i]``, whose length before the forward is ``starts[i]``.

    Args:
        slots: distinct cache slots.
        starts: each slot's length before the forward.
        counts: rows per slot (>= 1 each).
        trees: per slot, a token tree's key index and counts (``tree.key_index``, on the model's device), or
            None where the rows are consecutive tokens.
        positions: ``[N]`` each row's position (on the model's device).
        length: one past the largest position (the RoPE tables needed).
    """

    slots: Sequence[int]
    starts: list[int]
    counts: Sequence[int]
    trees: list[tuple[torch.Tensor, torch.Tensor] | None]
    positions: torch.Tensor
    length: int


def plan_rows(cache: Cache, slots: Sequence[int], counts: Sequence[int], n_rows: int,
              parents: Sequence[Sequence[int] | None] | None, window: int | None, device: torch.device) -> RowPlan:
    """Checks a ragged forward's rows against its slots and places them (see ``Transformer.forward_rows``).

    Args:
        cache: the KV cache the forward writes.
        slots, counts: as ``forward_rows`` takes them.
        n_rows: the forward's rows N.
        parents: per slot, None for consecutive rows or its tree's row parents (``tree.place_rows``); None: all
            consecutive.
        window: the model's sliding window, or None.
        device: where the model computes.

    Raises:
        ValueError: slots repeated, counts that do not fit the rows, a parents list of another length, a bad tree.
    """
    if len(counts) != len(slots) or len(set(slots)) != len(slots) or min(counts, default=0) < 1 \
            or sum(counts) != n_rows:
        raise ValueError(f"forward_rows needs distinct slots and a count >= 1 per slot summing to the "
                         f"{n_rows} rows; got slots {list(slots)}, counts {list(counts)}")
    if parents is not None and len(parents) != len(slots):
        raise ValueError(f"forward_rows needs one parents entry per slot: {len(parents)} for {len(slots)} slots")
    starts = [cache.lengths[s] for s in slots]
    positions: list[int] = []
    trees: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for i, (slot, start, n) in enumerate(zip(slots, starts, counts)):
        rows = None if parents is None else parents[i]
        if rows is None:
            positions += range(start, start + n)
            trees.append(None)
            continue
        tree.check_tree(range(len(rows)), rows)
        at, seen = tree.place_rows(rows, n, start, cache.visible(slot), window)
        positions += at
        trees.append(None if seen is None else (seen[0].to(device), seen[1].to(device)))
    return RowPlan(slots, starts, counts, trees, torch.tensor(positions, device=device), max(positions) + 1)
