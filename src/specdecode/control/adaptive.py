"""``adaptive``: ``cost``'s on/off decision, with each draft's length set token by token from its confidence.

While the cost model finds that speculation pays, the draft runs up to ``gamma_max`` and stops at the
first token after which one more is not worth its time: the expected gain of the next token (the
chance that it and all before it are accepted, from the calibrated acceptance model of
``confidence.py``) per second it costs (one draft token plus the verification's growth) falls below
the step's expected tokens per second so far. Without a fitted model for the drafter it is ``cost``
alone. It fits nothing offline.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.control.base import Signal, StepContext, StepRecord, memory_cap
from specdecode.control.confidence import CalibratedAcceptance
from specdecode.control.cost import CostGamma
from specdecode.control.model_file import AcceptanceModel


@dataclass
class AdaptiveGamma:
    """Cost-based on/off and probing, confidence-based draft length by marginal tokens per second.

    Args:
        model: the acceptance model for the drafter in use, or None (then: ``cost``'s gamma).
        gamma_max: the longest draft (shortened near the memory budget).
    """

    model: AcceptanceModel | None = None
    gamma_max: int = 8

    def __post_init__(self) -> None:
        self.cost = CostGamma(gamma_max=self.gamma_max)
        self.acceptance = CalibratedAcceptance(self.model) if self.model is not None else None
        self.early_stop = self.acceptance is not None
        self._ctx: StepContext | None = None
        self._stopping = False
        self._all_accepted = 1.0
        self._tokens = 1.0

    def next_gamma(self, ctx: StepContext) -> int:
        k = self.cost.next_gamma(ctx)
        self._stopping = k > 0 and self.acceptance is not None and self.cost.costs.ready and not self.cost.off.probing
        if not self._stopping:
            return k
        self._ctx, self._all_accepted, self._tokens = ctx, 1.0, 1.0
        return min(memory_cap(ctx, self.gamma_max), ctx.remaining - 1)

    def stop(self, position: int, signal: Signal) -> bool:
        if not self._stopping:
            return False
        p = self.acceptance.predict(signal, position, self._ctx)
        self._all_accepted *= p
        self._tokens += self._all_accepted
        costs = self.cost.costs
        drafted = position + 1
        step_s = costs.step_s(drafted)
        # Next token: gain P_i * p (p standing in for its own acceptance) over extra seconds, vs tokens/s so far.
        return self._all_accepted * p * step_s < (costs.step_s(drafted + 1) - step_s) * self._tokens

    def update(self, record: StepRecord) -> None:
        self.cost.update(record)
        if self.acceptance is not None:
            self.acceptance.learn(record)
