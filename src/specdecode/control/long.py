"""Long drafts: past ``gamma_max`` where the drafter has a long, trusted source (a prediction it follows, a
long suffix match), in steps that double while every drafted token is accepted.

Wraps a request's controller: while the drafter reports no long run (``Drafter.long_run``) the wrapped
controller decides alone, and it never sees the long steps. A long draft starts at ``start`` tokens and
doubles after each step that kept all of it, up to ``long_max``. A step that lost some of it ends a run (the
tokens kept since the previous loss): the next draft is as long as that run was (at least ``start``), since
the departures of an output from its source (an edit's changes) tend to come at similar distances, and a
wrong prediction costs a few short drafts, not long ones. In a batch (a step shared with other sequences) a long
draft is priced as every draft is, at the whole step (``estimates.best_gamma`` with the step costs the engine's
controllers share and its own per-token acceptance of long drafts): cut to the length that pays, or left to the
wrapped controller where none does. It does not draft or verify.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.control.base import GammaController, Signal, StepContext, StepRecord, memory_cap
from specdecode.control.estimates import StepCosts, best_gamma
from specdecode.drafters.base import Drafter

LONG_START = 4  # tokens of a long draft with nothing yet accepted: a miss costs 4 rows (~0.4 of a step here)
# A long draft's per-token acceptance before any was verified (a long match or a prediction is a trusted source),
# as pseudo-counts of that weight.
LONG_PRIOR, LONG_PRIOR_WEIGHT = 0.9, 4.0


@dataclass
class LongDrafts:
    """A controller that lets long draft sources run past the wrapped one's bound.

    Args:
        inner: the request's controller, for every step without a long run.
        drafter: the request's drafter (asked for its ``long_run`` before each step).
        long_max: the longest draft.
        start: the first long draft's length, and the shortest.
        costs: the step costs the engine's controllers share, to price a long draft in a batch (None: unpriced,
            as for controllers that weigh no costs).
        margin: how much more the batch's tokens per second must be with the draft than without it.
    """

    inner: GammaController
    drafter: Drafter
    long_max: int = 64
    start: int = LONG_START
    costs: StepCosts | None = None
    margin: float = 0.05

    def __post_init__(self) -> None:
        self.budget = min(self.start, self.long_max)
        self._run = 0  # tokens of long drafts kept since the last one that lost some
        self._long = False
        self._hits, self._seen = LONG_PRIOR * LONG_PRIOR_WEIGHT, LONG_PRIOR_WEIGHT  # long drafts' tokens

    @property
    def acceptance(self) -> float:
        """The chance that a long draft's next token is accepted, given that those before it were."""
        return self._hits / self._seen

    @property
    def early_stop(self) -> bool:
        return not self._long and self.inner.early_stop

    def next_gamma(self, ctx: StepContext) -> int:
        run = self.drafter.long_run()
        k = min(run, self.budget, memory_cap(ctx, self.long_max)) if run else 0  # (most steps have no long run)
        if k > 0 and ctx.others_rows and self.costs is not None and self.costs.ready:  # priced at the whole step
            p = self.acceptance
            k = best_gamma([p ** i for i in range(1, k + 1)], self.costs, self.margin, ctx.others_rows,
                           ctx.others_tokens)
        self._long = k > 0
        return k if self._long else self.inner.next_gamma(ctx)

    def stop(self, position: int, signal: Signal) -> bool:
        return not self._long and self.inner.stop(position, signal)

    def keep(self, drafted: int) -> int:
        return drafted if self._long else self.inner.keep(drafted)

    def update(self, record: StepRecord) -> None:
        if not self._long:
            self.inner.update(record)
            return
        # conditional acceptance: each kept token a hit, and the first rejected one a miss
        self._hits += record.accepted
        self._seen += record.accepted + (record.accepted < record.drafted)
        if record.drafted and record.accepted == record.drafted:
            self._run += record.accepted
            self.budget = min(2 * self.budget, self.long_max)
        elif record.drafted:
            run, self._run = self._run + record.accepted, 0
            self.budget = min(max(run, self.start), self.long_max)
