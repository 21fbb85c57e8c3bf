"""``confidence``: draft until the draft's own signals say the next token is unlikely to be accepted.

Each drafted token's signal (top-1 probability and entropy for model drafters; match statistics for
n-gram lookup), its position and the context go through a fitted logistic model (``model_file.py``)
that predicts its acceptance; an intercept shift learnt online from this request's verdicts corrects
the fit's calibration for the model at hand. It ignores costs and never turns speculation off (see
``adaptive.py``), and it does not fit anything offline (see ``fit.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.control.base import Signal, StepContext, StepRecord, memory_cap
from specdecode.control.model_file import AcceptanceModel, feature_row, sigmoid


@dataclass
class CalibratedAcceptance:
    """A fitted acceptance model plus an intercept ``shift`` fitted online (SGD on the logistic loss).

    Args:
        model: the fitted model.
        rate: step size of the online intercept update.
    """

    model: AcceptanceModel
    rate: float = 0.05
    shift: float = field(default=0.0, init=False)

    def predict(self, signal: Signal, position: int, ctx: StepContext) -> float:
        return sigmoid(self.shift + self.model.logit(feature_row(signal, position, ctx)))

    def learn(self, record: StepRecord) -> None:
        """One gradient step per judged token (those up to the first rejection; later ones were never judged)."""
        for i in range(min(len(record.signals), record.accepted + 1)):
            label = float(i < record.accepted)
            self.shift += self.rate * (label - self.predict(record.signals[i], i, record.ctx))


@dataclass
class ConfidenceGamma:
    """Stops a draft once the chance that a further token would be accepted falls below ``threshold``.

    That chance, after token i, is estimated as P_i * p_i: P_i that tokens 1..i are all accepted
    (the product of their predicted acceptances), p_i standing in for the next token's own.

    Args:
        model: the acceptance model for the drafter in use.
        gamma_max: the longest draft (shortened near the memory budget, see ``memory_cap``).
        threshold: stop below this chance.
    """

    model: AcceptanceModel
    gamma_max: int = 8
    threshold: float = 0.4
    early_stop = True

    def __post_init__(self) -> None:
        self.acceptance = CalibratedAcceptance(self.model)
        self._ctx: StepContext | None = None
        self._all_accepted = 1.0

    def next_gamma(self, ctx: StepContext) -> int:
        self._ctx, self._all_accepted = ctx, 1.0
        return memory_cap(ctx, self.gamma_max)

    def stop(self, position: int, signal: Signal) -> bool:
        p = self.acceptance.predict(signal, position, self._ctx)
        self._all_accepted *= p
        return self._all_accepted * p < self.threshold

    def keep(self, drafted: int) -> int:
        return drafted

    def update(self, record: StepRecord) -> None:
        self.acceptance.learn(record)
