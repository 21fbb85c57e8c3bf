"""``cost``: the gamma (0 included) with the most expected tokens per second, from costs measured online.

Each step it maximises E(k) / (k * t_draft + t_verify(k)) over k (see ``estimates.best_gamma``), with
per-position acceptance learnt from this request's steps (starting from the engine's long-run
estimate), and draft cost and verification curve learnt across the engine's requests (the curve timed
at warm-up, see ``estimates.SharedEstimates``). When no k pays (low acceptance, a costly draft, the
last tokens of the budget) speculation is off; a short probe now and then, spaced so that probing
costs about ``probe_overhead`` of the time, turns it back on when it would pay again. It does not
look at the draft's confidence (see ``adaptive.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdecode.control.base import Signal, StepContext, StepRecord, memory_cap
from specdecode.control.estimates import PositionAcceptance, SharedEstimates, StepCosts, best_gamma


@dataclass
class OffSwitch:
    """Counts the steps spent off and says when to probe.

    Args:
        probe_gamma: tokens drafted by a probe.
        probe_overhead: share of the off time that probes may cost.
        min_interval: fewest off steps between probes.
        max_interval: most off steps between probes.
    """

    probe_gamma: int = 2
    probe_overhead: float = 0.02
    min_interval: int = 4
    max_interval: int = 64
    off_steps: int = field(default=0, init=False)
    probing: bool = field(default=False, init=False)

    def interval(self, costs: StepCosts, ctx: StepContext | None = None) -> int:
        """Off steps between probes: a probe's extra time over a plain step, divided by the overhead allowed.

        In a batch (``ctx.others_tokens`` other sequences) a probe slows every sequence's step and each of
        them probes: the spacing (its bounds too) grows with the sequences sharing the step."""
        others_rows, sharers = (ctx.others_rows, 1.0 + ctx.others_tokens) if ctx is not None else (0, 1.0)
        steps = costs.step_curve(self.probe_gamma, others_rows)
        plain = steps[0]
        extra = sharers * (steps[self.probe_gamma] - plain) / plain
        spacing = max(self.min_interval, math.ceil(extra / self.probe_overhead))
        return min(math.ceil(self.max_interval * sharers), spacing)

    def decide(self, best: int, cap: int, costs: StepCosts, ctx: StepContext | None = None) -> int:
        """The gamma to run when the cost model chose ``best`` (0 = off) and at most ``cap`` may be drafted
        (``ctx``: the step's, for a batch's probe spacing; None: a lone sequence's)."""
        self.probing = False
        if best > 0:
            self.off_steps = 0
            return best
        self.off_steps += 1
        if self.off_steps >= self.interval(costs, ctx):
            self.off_steps = 0
            self.probing = True
            return min(self.probe_gamma, cap)
        return 0


@dataclass
class CostGamma:
    """Cost-based gamma with an off switch.

    Args:
        gamma_max: upper bound.
        start_gamma: gamma until a draft and a verification have been timed.
        margin: how much faster than plain decoding a draft must be predicted to run to be chosen (the
            model leaves out the per-step bookkeeping of speculation, and a marginal gain is within the
            estimates' noise; on SmolLM2 self-speculation, drafting one token at 0.9 acceptance was
            predicted 1% faster than plain decoding and ran slower).
        probe_forget: share of older acceptance evidence kept when a probe's result arrives (a probe
            speaks for now; the evidence that turned speculation off is old).
        acceptance: this request's per-position acceptance estimate (None: one started from ``shared``).
        off: the off switch and its probes.
        shared: step costs and long-run acceptance, shared with the engine's other requests (None: this
            request's own).
    """

    gamma_max: int = 8
    start_gamma: int = 4
    margin: float = 0.05
    probe_forget: float = 0.1
    acceptance: PositionAcceptance | None = None
    off: OffSwitch = field(default_factory=OffSwitch)
    shared: SharedEstimates | None = None
    early_stop = False

    def __post_init__(self) -> None:
        self.shared = self.shared or SharedEstimates(self.gamma_max)
        self.acceptance = self.acceptance or self.shared.request_acceptance()
        self.costs = self.shared.costs
        self.drafted_before = True  # the drafter is prefilled with the prompt: nothing to catch up on

    def next_gamma(self, ctx: StepContext) -> int:
        cap = min(memory_cap(ctx, self.gamma_max), ctx.remaining - 1)
        if cap <= 0:
            return 0
        if not self.costs.ready:
            return min(self.start_gamma, cap)
        best = best_gamma(self.acceptance.cumulative(cap), self.costs, self.margin, ctx.others_rows,
                          ctx.others_tokens)
        return self.off.decide(best, cap, self.costs, ctx)

    def stop(self, position: int, signal: Signal) -> bool:
        return False

    def keep(self, drafted: int) -> int:
        return drafted

    def update(self, record: StepRecord) -> None:
        if self.off.probing and record.drafted:
            self.acceptance.forget(self.probe_forget)
        self.acceptance.update(record.drafted, record.accepted)
        self.shared.acceptance.update(record.drafted, record.accepted)
        # After steps without a draft, a draft model first catches up on the tokens it missed: not a draft cost.
        self.costs.update(record.drafted, record.draft_s, record.verify_s, draft_timed=self.drafted_before,
                          others=record.others_rows)
        self.drafted_before = record.requested > 0
