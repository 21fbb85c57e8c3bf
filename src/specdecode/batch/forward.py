"""The step's one target forward: every running sequence's rows laid out, padded, and run with the output head
only where acceptance needs it, each constrained row masked by its grammar.

Rows are laid out by ``rows.py`` (prompt rows, then ``[last token, drafts]`` per sequence), filler rows pad the
forward to what ``costs.RowPadding`` asks for, and a step whose grammars leave every scored row one token runs
without the output head (``grammar_rows.decided``). A drafter that reads the target's features gets each
prefilling sequence's prompt rows here. It does not verify or roll back (``acceptance.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.batch.costs import RowPadding
from specdecode.batch.grammar_rows import decided, grammar_masks, mask_constrained, one_hot
from specdecode.batch.penalty_rows import penalize_rows
from specdecode.batch.proposing import NO_DRAFT, StepPlan
from specdecode.batch.rows import ForwardRows, SequenceRows, lay_out
from specdecode.batch.sequence import SequenceState
from specdecode.batch.target_kv import TargetKV
from specdecode.models.rows import LogitRows
from specdecode.models.transformer import Transformer


@dataclass(kw_only=True)
class ForwardResult:
    """One step's forward, as acceptance reads it.

    Args:
        decoding: the decoding sequences' parts, in the forward's order.
        rows: the forward's rows (``first``: each sequence's first row).
        logits: ``[scored rows, V]`` float32, the decoding rows', each constrained row masked by its grammar.
        features: ``[N, F]`` the rows' features when a drafter reads them, else None.
        real_rows: the forward's rows without the padding.
    """

    decoding: list[SequenceRows]
    rows: ForwardRows
    logits: torch.Tensor
    features: torch.Tensor | None
    real_rows: int


@dataclass(kw_only=True)
class StepForward:
    """Runs a step's forward.

    Args:
        target: the model.
        kv: its cache over the engine's slots.
        padding: filler rows a forward needs or runs fastest with.
        features: the target layers whose features the drafters read (none: no features computed).
    """

    target: Transformer
    kv: TargetKV
    padding: RowPadding
    features: tuple[int, ...] = ()

    def run(self, running: list[SequenceState], plan: StepPlan) -> ForwardResult:
        """The forward over ``running``'s rows as ``plan`` has them; moves each prefilling sequence's ``prefilled``
        past the prompt rows it read."""
        cache = self.kv.cache
        parts = [SequenceRows(seq=seq, slot=seq.slot, cached=cache.lengths[seq.slot],
                              prompt=seq.tokens[seq.prefilled:seq.prefilled + plan.chunk.get(seq, 0)],
                              last=seq.tokens[-1] if seq in plan.proposals else None,
                              draft=plan.proposals[seq].draft if seq in plan.proposals else NO_DRAFT)
                 for seq in running]
        rows = lay_out(parts)
        real = len(rows.tokens)
        self._pad(rows)
        decoding = [p for p in parts if p.decodes]
        masks = grammar_masks(decoding)  # before the forward: they depend only on the drafts
        sole = decided(decoding, masks)  # when a grammar leaves every scored row one token: no head at all
        head_rows = LogitRows.NONE if sole else LogitRows.at(torch.tensor(rows.scored, dtype=torch.long))
        out = self.target.forward_rows(torch.tensor(rows.tokens, device=self.target.device), cache, rows.slots,
                                       rows.counts, logits=head_rows, features=self.features, parents=rows.parents)
        if sole:
            logits = one_hot(sole, self.target.config.vocab_size, self.target.device)  # [scored, V]
        else:
            logits = out.logits  # [scored, V]
            penalize_rows(logits, decoding)
            mask_constrained(logits, decoding, masks)
        for seq, n in plan.chunk.items():
            if out.features is not None and n:  # a head drafter reads the prompt's features as they are computed
                seq.drafter.observe(seq.prefilled, out.features[rows.first[seq]:rows.first[seq] + n])
            seq.prefilled += n
            if n and not seq.prompt_pending:  # the prompt is whole: its blocks go to the prefix cache
                self.kv.store_prefix(seq.slot, seq.tokens[:seq.prefilled])
        return ForwardResult(decoding=decoding, rows=rows, logits=logits, features=out.features, real_rows=real)

    def _pad(self, rows: ForwardRows) -> None:
        """Filler rows up to the row count the padding table asks for, within the last run's slot's room.
        (Filler is only ever needed off our kernels, where no prompt is prefilled in a step: the last
        sequence decodes, and its rollback drops them.)"""
        room = self.kv.room(rows.slots[-1]) - rows.counts[-1]
        rows.pad(self.padding.rows(len(rows.tokens), len(rows.tokens) + room))
