"""Long drafts: past ``gamma_max`` where the drafter has a long, trusted source (a prediction it follows, a
long suffix match), in steps that double while every drafted token is accepted.

Wraps a request's controller: while the drafter reports no long run (``Drafter.long_run``) the wrapped
controller decides alone, and it never sees the long steps. A long draft starts at ``start`` tokens and
doubles after each step that kept all of it, up to ``long_max``. A step that lost some of it ends a run (the
tokens kept since the previous loss): the next draft is as long as that run was (at least ``start``), since
the departures of an output from its source (an edit's changes) tend to come at similar distances, and a
wrong prediction costs a few short drafts, not long ones. It does not draft or verify.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.control.base import GammaController, Signal, StepContext, StepRecord, memory_cap
from specdecode.drafters.base import Drafter

LONG_START = 4  # tokens of a long draft with nothing yet accepted: a miss costs 4 rows (~0.4 of a step here)


@dataclass
class LongDrafts:
    """A controller that lets long draft sources run past the wrapped one's bound.

    Args:
        inner: the request's controller, for every step without a long run.
        drafter: the request's drafter (asked for its ``long_run`` before each step).
        long_max: the longest draft.
        start: the first long draft's length, and the shortest.
    """

    inner: GammaController
    drafter: Drafter
    long_max: int = 64
    start: int = LONG_START

    def __post_init__(self) -> None:
        self.budget = min(self.start, self.long_max)
        self._run = 0  # tokens of long drafts kept since the last one that lost some
        self._long = False

    @property
    def early_stop(self) -> bool:
        return not self._long and self.inner.early_stop

    def next_gamma(self, ctx: StepContext) -> int:
        run = self.drafter.long_run()
        self._long = run > 0
        if not self._long:
            return self.inner.next_gamma(ctx)
        return min(run, self.budget, memory_cap(ctx, self.long_max))

    def stop(self, position: int, signal: Signal) -> bool:
        return not self._long and self.inner.stop(position, signal)

    def update(self, record: StepRecord) -> None:
        if not self._long:
            self.inner.update(record)
        elif record.drafted and record.accepted == record.drafted:
            self._run += record.accepted
            self.budget = min(2 * self.budget, self.long_max)
        elif record.drafted:
            run, self._run = self._run + record.accepted, 0
            self.budget = min(max(run, self.start), self.long_max)
