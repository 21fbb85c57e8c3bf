"""The original document's rule: gamma from a running acceptance rate, gamma = floor(1 / (1 - a)).

Kept as the baseline the other controllers are measured against: it never turns speculation off,
ignores costs, draft confidence and memory, and never stops a draft early.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdecode.control.base import Signal, StepContext, StepRecord
from specdecode.stats import token_acceptance


def agreement_gamma(acceptance: float, gamma_max: int) -> int:
    """The original document's rule, gamma = min(gamma_max, floor(1 / (1 - a))), at least 1; capped at a = 1."""
    if acceptance >= 1.0:
        return gamma_max
    # The epsilon keeps exact fractions (a = 2/3 -> 3) from flooring one too low through rounding.
    return max(1, min(gamma_max, math.floor(1.0 / (1.0 - acceptance) + 1e-9)))


@dataclass
class AgreementGamma:
    """Gamma from an exponentially averaged acceptance rate.

    Args:
        gamma_max: upper bound.
        smoothing: weight of the newest step in the running average.
        acceptance: starting estimate (0.75 gives gamma 4, the usual fixed default).
    """

    gamma_max: int = 8
    smoothing: float = 0.3
    acceptance: float = 0.75
    early_stop = False

    def next_gamma(self, ctx: StepContext) -> int:
        return agreement_gamma(self.acceptance, self.gamma_max)

    def stop(self, position: int, signal: Signal) -> bool:
        return False

    def keep(self, drafted: int) -> int:
        return drafted

    def update(self, record: StepRecord) -> None:
        if record.drafted:
            # Per-token acceptance of this step: tokens after the first rejection were never judged.
            step = token_acceptance(record.accepted, int(record.accepted < record.drafted))
            self.acceptance += self.smoothing * (step - self.acceptance)
