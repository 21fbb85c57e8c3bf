"""How far an engine speculates: the gamma policy and its bounds, checked when built.

It only holds and checks settings; the controllers themselves are in this package's other modules.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.control import GAMMA_POLICIES

MAX_GAMMA = 64
MAX_LONG = 256


@dataclass(frozen=True)
class SpeculativeConfig:
    """How far to speculate.

    Args:
        gamma: tokens drafted per step (0 = speculation off), or the name of a controller in GAMMA_POLICIES
            (default ``adaptive``: in ``specdecode bench`` it beat the best fixed gamma with a draft model,
            with self-speculation and with n-gram lookup; see docs/benchmarks/history.md, "Adaptive gamma").
        gamma_max: upper bound for controllers.
        controller_file: the acceptance models of the ``confidence`` and ``adaptive`` controllers
            (written by ``specdecode fit-controller``); None = the file shipped with the package.
        long_max: the longest draft from a long, trusted source (a request's prediction, a long suffix match),
            which may pass ``gamma_max`` (``control/long.py``); 0 = never past the gamma policy's bound.
    """

    gamma: int | str = "adaptive"
    gamma_max: int = 8
    controller_file: str | None = None
    long_max: int = 64

    def __post_init__(self) -> None:
        if isinstance(self.gamma, str):
            if self.gamma not in GAMMA_POLICIES:
                raise ValueError(f"SpeculativeConfig.gamma={self.gamma!r}: expected an integer 0..{MAX_GAMMA} "
                                 f"or one of {GAMMA_POLICIES}")
        elif not 0 <= self.gamma <= MAX_GAMMA:
            raise ValueError(f"SpeculativeConfig.gamma must be in 0..{MAX_GAMMA}, got {self.gamma}")
        if not 1 <= self.gamma_max <= MAX_GAMMA:
            raise ValueError(f"SpeculativeConfig.gamma_max must be in 1..{MAX_GAMMA}, got {self.gamma_max}")
        if not 0 <= self.long_max <= MAX_LONG:
            raise ValueError(f"SpeculativeConfig.long_max must be in 0..{MAX_LONG}, got {self.long_max}")

    @property
    def max_draft(self) -> int:
        """The most tokens a single step may draft."""
        return self.gamma if isinstance(self.gamma, int) else self.gamma_max

    @property
    def longest_draft(self) -> int:
        """The most tokens a single step may draft, long drafts included (what a KV slot leaves room for)."""
        return max(self.max_draft, self.long_max)
