"""Step records and stats: what a decoding sequence's step is to its controller (a ``StepRecord`` of the drafter's
own tokens), to its ``RequestStats`` and to the engine's observer.

A grammar's forced tokens lead a draft but are not the drafter's choice: they are counted apart, and where one was
rejected the drafter's tokens after it were never judged and none count. It decides nothing; it times only the
controller's update (as control).
"""

from __future__ import annotations

import time

from specdecode.batch.observer import StepObserver
from specdecode.batch.proposing import Proposal
from specdecode.batch.sequence import SequenceState
from specdecode.control import StepRecord
from specdecode.verify import Verdict


def drafter_record(proposal: Proposal, verdict: Verdict, verify_s: float, others_rows: int) -> StepRecord:
    """A step as its controller learns it: the drafter's own tokens, the forced ones apart."""
    draft = proposal.draft
    forced = draft.forced
    judged = verdict.accepted >= forced and len(draft.tokens) > forced
    return StepRecord(ctx=proposal.context, requested=proposal.budget - forced if judged else 0,
                      drafted=len(draft.tokens) - forced if judged else 0,
                      accepted=verdict.accepted - forced if judged else 0, draft_s=proposal.draft_s,
                      verify_s=verify_s, signals=draft.signals if judged else (), others_rows=others_rows,
                      forced=forced, forced_accepted=min(verdict.accepted, forced))


def record_step(seq: SequenceState, proposal: Proposal, verdict: Verdict, kept: int, verify_s: float,
                others_rows: int, observer: StepObserver | None) -> None:
    """Hands ``seq``'s step to its controller, its stats and the ``observer``; ``kept``: tokens it emitted."""
    record = drafter_record(proposal, verdict, verify_s, others_rows)
    tick = time.perf_counter()
    seq.controller.update(record)
    stats = seq.stats
    stats.control_s += time.perf_counter() - tick
    stats.record_step(len(proposal.draft.tokens), verdict.accepted, kept, proposal.draft.tree_depth)
    stats.forced_drafted += record.forced
    stats.forced_accepted += record.forced_accepted
    stats.draft_s += proposal.draft_s
    stats.verify_s += verify_s
    if observer is not None:
        observer.stepped(seq, record, kept, time.perf_counter())
