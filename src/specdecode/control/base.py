"""What every gamma controller sees and says: the per-step context, the step record and the protocol.

Besides the protocol it holds only the fixed gamma and the memory cap shared by the adaptive
controllers. It does not draft, verify or time anything: the engine measures and passes the numbers in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

from specdecode.drafters.base import Signal


@dataclass(frozen=True, kw_only=True)
class StepContext:
    """What the engine knows before a step.

    Args:
        remaining: tokens still allowed by ``max_new_tokens`` (>= 1).
        context_len: tokens in the sequence so far (prompt + generated).
        max_context: the model's context length.
        cache_fill: share of the KV cache's memory budget in use (0..1), None when the cache has no budget.
        kv: the KV cache's storage setting: its dtype ("bfloat16", "float32") or a compression
            ("int8", "int4", "window").
        others_rows: in a batch, rows the other sequences are expected to put in the same forward (a
            draft then also prices their share of the step).
        others_tokens: in a batch, tokens the other sequences are expected to emit in that step.
    """

    remaining: int
    context_len: int
    max_context: int
    cache_fill: float | None = None
    kv: str = "bfloat16"
    others_rows: int = 0
    others_tokens: float = 0.0

    @property
    def context_used(self) -> float:
        """Share of the model's context the sequence fills."""
        return self.context_len / self.max_context

    @property
    def pressure(self) -> float:
        """Memory pressure in 0..1: the larger of the cache fill and the share of the context used."""
        return self.context_used if self.cache_fill is None else max(self.context_used, self.cache_fill)


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """What one step did, as the engine measured it.

    Args:
        ctx: the context the step was decided in.
        requested: the gamma the engine asked the drafter for (after its budget cap).
        drafted: tokens the drafter proposed (fewer than requested when it stopped early or had nothing).
        accepted: drafted tokens the target accepted.
        draft_s: seconds spent drafting (early-stop decisions included).
        verify_s: seconds of the verification forward.
        signals: per drafted token, the drafter's confidence signals (see ``Drafter.signal_names``).
        others_rows: rows other sequences had in the verification forward (a batch's).
        forced, forced_accepted: tokens a grammar forced ahead of the draft (``drafters/forced.py``), and those
            kept; not counted in ``requested``/``drafted``/``accepted``, which are the drafter's.
    """

    ctx: StepContext
    requested: int
    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    signals: Sequence[Signal] = ()
    others_rows: int = 0
    forced: int = 0
    forced_accepted: int = 0


class GammaController(Protocol):
    """Chooses how far to speculate. One instance serves one request; its calls must cost microseconds.

    ``early_stop`` says whether the engine should pass :meth:`stop` to the drafter (read after each
    :meth:`next_gamma`: it may change from step to step).
    """

    early_stop: bool

    def next_gamma(self, ctx: StepContext) -> int:
        """Tokens to draft next (an upper bound when ``early_stop``); 0 turns speculation off for that step."""

    def stop(self, position: int, signal: Signal) -> bool:
        """Called after each drafted token (``position`` 0-based) with its signal: True ends the draft there."""

    def keep(self, drafted: int) -> int:
        """How many of the ``drafted`` tokens to verify, once the draft is made: all, or fewer (none) where its
        tokens' own signals say the step does better without them. Asked only for a deterministic chain (a
        sampled draft's length must not depend on what it drew)."""

    def update(self, record: StepRecord) -> None:
        """Learns from the step that just ran."""


@dataclass
class FixedGamma:
    """Always the same gamma (0 = plain decoding through the same loop)."""

    gamma: int
    early_stop = False

    def next_gamma(self, ctx: StepContext) -> int:
        return self.gamma

    def stop(self, position: int, signal: Signal) -> bool:
        return False

    def keep(self, drafted: int) -> int:
        return drafted

    def update(self, record: StepRecord) -> None:
        pass


def memory_cap(ctx: StepContext, gamma_max: int, taper_from: float = 0.8) -> int:
    """The longest draft memory allows: ``gamma_max`` up to ``taper_from`` pressure, then linearly shorter,
    down to 1 when the cache budget (or the context) is full.

    Drafted tokens take cache slots until they are verified; near the budget a long draft is the first
    thing to give up.

    Args:
        ctx: the step's context (its ``pressure``).
        gamma_max: the cap without pressure.
        taper_from: pressure at which drafts start to shorten.
    """
    pressure = ctx.pressure
    if pressure <= taper_from:
        return gamma_max
    # The epsilon keeps exact fractions (0.1 / 0.2) from flooring one too low through rounding.
    return max(1, math.floor(gamma_max * (1.0 - pressure) / (1.0 - taper_from) + 1e-9))
