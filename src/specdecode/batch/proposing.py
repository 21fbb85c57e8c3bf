"""Proposing: one step's row budget shared out, and each decoding sequence's draft.

The budget goes to each decoding sequence's fed token, then to the prompts still being read (oldest first), then
to drafts, decided in turn (who goes first turns each step, so that no sequence always finds the room taken). Each
sequence's controller prices its draft at the forward it joins: the others' fed tokens, the prompt rows, the drafts
proposed before it and, for those still to draft, drafts as long as their last ones. Under a grammar the forced
tokens come on top of the controller's choice, and a draft is cut where the grammar refuses it.

It does not run the target, verify or roll back (``forward.py``, ``acceptance.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specdecode.batch.scheduler import SchedulerConfig
from specdecode.batch.sequence import SequenceState
from specdecode.batch.target_kv import TargetKV
from specdecode.control import StepContext
from specdecode.control.config import SpeculativeConfig
from specdecode.drafters.base import Draft, StopRule
from specdecode.drafters.forced import within

NO_DRAFT = Draft([])


@dataclass(kw_only=True)
class Proposal:
    """A decoding sequence's part of a step.

    Args:
        draft: what it drafted (empty: a plain step).
        budget: the most tokens it could draft (0: a plain step).
        context: what its controller decided in.
        draft_s: seconds drafting took.
    """

    draft: Draft
    budget: int
    context: StepContext
    draft_s: float = 0.0


@dataclass(kw_only=True)
class StepPlan:
    """What one step runs: prompt rows per prefilling sequence and each decoding one's proposal.

    Args:
        chunk: prompt rows each prefilling sequence reads this step.
        decoding: the decoding sequences in drafting order (a prompt finished this step last, undrafted).
        rows: the forward's rows so far (fed tokens, prompt rows, the drafts already proposed).
        room: draft rows still within the step's budget.
        expected: rows of the drafts still to come (as long as those sequences' last ones).
        proposals: each decoding sequence's proposal, once made.
    """

    chunk: dict[SequenceState, int]
    decoding: list[SequenceState]
    rows: int
    room: int
    expected: int
    proposals: dict[SequenceState, Proposal] = field(default_factory=dict)

    def turn_of(self, seq: SequenceState) -> int:
        """Starts ``seq``'s turn; returns the rows the others put in the forward its draft joins (its own
        expected draft leaves ``expected``: it is the one being decided)."""
        self.expected -= seq.last_rows - 1
        return self.rows - 1 + self.expected

    def add(self, seq: SequenceState, proposal: Proposal) -> None:
        """Records ``seq``'s proposal: its draft's rows join the forward and leave the room."""
        self.proposals[seq] = proposal
        self.rows += len(proposal.draft.tokens)
        self.room -= len(proposal.draft.tokens)


@dataclass(kw_only=True)
class Proposer:
    """Plans each step and asks each decoding sequence's drafter chain for its draft.

    Args:
        kv: the target's cache (a draft never reaches past a slot's next compression step; the budget's fill).
        limits: the scheduler's row budget (``max_rows``) and prompt chunk.
        spec: the speculation settings (a lone sequence's long drafts may pass ``max_rows``).
        max_len: tokens one sequence may hold (the controllers' context).
        kv_kind: the cache's storage as the controllers see it (``target_kv.kv_setting``).
        record_signals: have drafters compute every drafted token's signal even when no controller stops
            drafts early (step records).
    """

    kv: TargetKV
    limits: SchedulerConfig
    spec: SpeculativeConfig
    max_len: int
    kv_kind: str
    record_signals: bool = False
    steps: int = 0  # steps planned: whose turn it is to draft first

    def plan(self, running: list[SequenceState]) -> StepPlan:
        """The step's plan for ``running`` with every decoding sequence's proposal made."""
        plan = self._share(running)
        for seq in plan.decoding:
            if seq in plan.proposals:  # its prompt finished in this step: it decodes undrafted
                continue
            context = self._context(seq, plan.turn_of(seq), len(plan.decoding) - 1)
            budget = self._budget(seq, context, plan.room)
            start = time.perf_counter()
            draft = self._draft(seq, budget)
            plan.add(seq, Proposal(draft=draft, budget=budget, context=context,
                                   draft_s=time.perf_counter() - start))
        return plan

    def _share(self, running: list[SequenceState]) -> StepPlan:
        """Shares the row budget: each decoding sequence's fed token, then prompts (oldest first), then drafts.
        With nobody decoding, nobody waits between tokens: prompts then go in larger chunks."""
        decoding = [s for s in running if not s.prompt_pending]
        budget = self.limits.max_rows - len(decoding) if decoding else self.limits.prefill_chunk
        chunk: dict[SequenceState, int] = {}
        for seq in running:
            if seq.prompt_pending and budget:
                chunk[seq] = min(seq.prompt_pending, budget)
                budget -= chunk[seq]
        if len(running) == 1 and decoding:  # a lone sequence delays nobody: its long drafts may pass max_rows
            budget = max(budget, self.spec.longest_draft)
        if decoding:  # who drafts first turns each step
            turn = self.steps % len(decoding)
            decoding = decoding[turn:] + decoding[:turn]
        self.steps += 1
        # A prompt finished this step decodes in the same forward (its rows follow its last prompt rows), undrafted.
        finished = [seq for seq, n in chunk.items() if n == seq.prompt_pending]
        plan = StepPlan(chunk=chunk, decoding=decoding + finished, rows=len(decoding) + sum(chunk.values()),
                        room=budget, expected=sum(s.last_rows - 1 for s in decoding))
        for seq in finished:
            context = self._context(seq, plan.rows - chunk[seq] + plan.expected, len(plan.decoding) - 1)
            plan.add(seq, Proposal(draft=NO_DRAFT, budget=0, context=context))
        return plan

    def _budget(self, seq: SequenceState, context: StepContext, room: int) -> int:
        """The most tokens ``seq`` may draft now: its controller's choice plus the grammar's forced tokens, within
        the room left. Drafting past the budget is wasted work (the extra tokens would be cut), and no step may
        reach past the cache's next compression step (it would show later rows an older cache state)."""
        if seq.drafter is None:
            return 0
        tick = time.perf_counter()
        k = min(seq.controller.next_gamma(context) + seq.drafter.forced_ahead(), seq.remaining - 1,
                self.kv.cache.stable_rows(seq.slot) - 1, room)
        seq.stats.control_s += time.perf_counter() - tick
        return k

    def _context(self, seq: SequenceState, others_rows: int, others: int) -> StepContext:
        return StepContext(remaining=seq.remaining, context_len=len(seq.tokens), max_context=self.max_len,
                           cache_fill=self.kv.fill, kv=self.kv_kind, others_rows=others_rows,
                           others_tokens=float(others))

    def _draft(self, seq: SequenceState, k: int) -> Draft:
        if not k:
            return NO_DRAFT
        draft = seq.drafter.propose(seq.tokens, k, seq.request.sampling, seq.generator,
                                    self._stop_rule(seq)).check(k, seq.drafter.name)
        draft = draft if seq.constraint is None else within(draft, seq.constraint)
        return self._kept(seq, draft)

    @staticmethod
    def _kept(seq: SequenceState, draft: Draft) -> Draft:
        """The part of a deterministic chain its controller keeps, having seen its tokens' signals (a sampled
        draft's length must not depend on what it drew; a grammar's forced tokens stay)."""
        if draft.q is not None or draft.parents is not None or draft.forced or not draft.tokens:
            return draft
        tick = time.perf_counter()
        n = seq.controller.keep(len(draft.tokens))
        seq.stats.control_s += time.perf_counter() - tick
        return draft if n >= len(draft.tokens) else Draft(draft.tokens[:n], None, draft.signals[:n])

    def _stop_rule(self, seq: SequenceState) -> StopRule | None:
        """The controller's early stop, timed as control (None, so no signals are computed, unless a controller
        stops early or step records want the signals)."""
        controller, stats = seq.controller, seq.stats
        if not (controller.early_stop or self.record_signals):
            return None

        def timed_stop(position: int, signal: tuple[float, ...]) -> bool:
            tick = time.perf_counter()
            done = controller.stop(position, signal)
            stats.control_s += time.perf_counter() - tick
            return done
        return timed_stop
