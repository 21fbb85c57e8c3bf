"""The rows of one step's target forward: which tokens, in which cache slots, with which tree parents.

A step's forward holds, per running sequence and in its order, the prompt rows it prefills this step
(if any) and, if it decodes, ``[last token, d_1..d_k]``: every token but the last is already cached, so
the last one is fed again. Only decoding rows get logits. Filler rows (copies of the last row) may follow
everything, to reach the row count a forward needs or runs fastest at; no real row sees them, and the
last sequence's rollback drops them.

This module only lays rows out; it does not run the model, verify, or touch a cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specdecode.batch.sequence import SequenceState
from specdecode.drafters.base import Draft


@dataclass(kw_only=True)
class SequenceRows:
    """One sequence's part of a step.

    Args:
        seq: the sequence.
        slot: its cache slot.
        cached: tokens its slot holds before the step.
        prompt: prompt tokens it prefills this step (written from ``cached`` on).
        last: its last token (fed again ahead of the draft), or None when it does not decode this step.
        draft: what was drafted after ``last`` (empty for a plain step).
    """

    seq: SequenceState
    slot: int
    cached: int
    prompt: Sequence[int] = ()
    last: int | None = None
    draft: Draft = field(default_factory=lambda: Draft([]))

    @property
    def decodes(self) -> bool:
        return self.last is not None

    @property
    def held(self) -> int:
        """Cache length at its fed token's row (where a decoding sequence's verified rows start)."""
        return self.cached + len(self.prompt)


@dataclass
class ForwardRows:
    """A forward's rows, as ``Transformer.forward_rows`` takes them.

    Args:
        tokens: ``[N]`` token ids, each sequence's rows consecutive.
        slots: the cache slot of each sequence's run of rows.
        counts: rows per run.
        parents: per run, the rows' tree parents within the run (None for a chain), see ``tree.key_index``.
        scored: rows that get logits: every decoding sequence's ``[last, d_1..d_k]``.
        first: each sequence's first row.
    """

    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    parents: list[list[int] | None] = field(default_factory=list)
    scored: list[int] = field(default_factory=list)
    first: dict[SequenceState, int] = field(default_factory=dict)

    def pad(self, rows: int) -> None:
        """Appends copies of the last row up to ``rows`` rows (to the last run, whose rollback drops them)."""
        filler = rows - len(self.tokens)
        if filler <= 0:
            return
        if self.parents[-1] is not None:  # each filler row hangs under the one before it
            self.parents[-1] += range(self.counts[-1] - 1, self.counts[-1] - 1 + filler)
        self.counts[-1] += filler
        self.tokens += [self.tokens[-1]] * filler


def lay_out(parts: Sequence[SequenceRows]) -> ForwardRows:
    """The rows of ``parts``, in their order (each with rows: prompt rows, a decode step, or both)."""
    rows = ForwardRows()
    for part in parts:
        tokens = list(part.prompt)
        n = len(tokens)
        tree = None
        if part.decodes:
            rows.scored += range(len(rows.tokens) + n, len(rows.tokens) + n + 1 + len(part.draft.tokens))
            tokens += [part.last, *part.draft.tokens]
            tree = part.draft.row_parents(offset=n)
        if not tokens:
            continue
        rows.first[part.seq] = len(rows.tokens)
        rows.tokens += tokens
        rows.slots.append(part.slot)
        rows.counts.append(len(tokens))
        rows.parents.append(None if tree is None else list(range(-1, n - 1)) + tree)  # prompt rows: a chain
    return rows
