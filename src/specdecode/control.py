"""Gamma controllers: how many tokens to draft at the next step.

A controller sees only counts (drafted, accepted) after each step; it does not draft, verify or time.
State is per request: the engine builds a fresh controller for each one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from specdecode.stats import token_acceptance


class GammaController(Protocol):
    def next_gamma(self) -> int:
        """Tokens to draft next; 0 turns speculation off for that step."""

    def update(self, drafted: int, accepted: int) -> None:
        """Learns from the step that just ran."""


@dataclass
class FixedGamma:
    """Always the same gamma (0 = plain decoding through the same loop)."""

    gamma: int

    def next_gamma(self) -> int:
        return self.gamma

    def update(self, drafted: int, accepted: int) -> None:
        pass


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

    def next_gamma(self) -> int:
        return agreement_gamma(self.acceptance, self.gamma_max)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            # Per-token acceptance of this step: tokens after the first rejection were never judged.
            step = token_acceptance(accepted, int(accepted < drafted))
            self.acceptance += self.smoothing * (step - self.acceptance)


def make_controller(gamma: int | str, gamma_max: int) -> GammaController:
    """Builds the controller a ``SpeculativeConfig.gamma`` names."""
    if gamma == "agreement":
        return AgreementGamma(gamma_max=gamma_max)
    return FixedGamma(int(gamma))
