"""The verification cost curve v(k): what checking k drafted tokens costs, relative to one decode step.

Speculation pays when v(k) stays near 1 (speedup = E / (k*c + v(k)), E the expected tokens per step,
c the draft cost per token). The curve is measured through ``Engine.verify_timer``, i.e. the very forward
(padding included) and greedy pick that decoding runs, rolled back, at the context of a real prompt; sizes
are interleaved (k = 0..K, K..0, ...) so that drift on a noisy machine spreads over all of them. This module
does not run prompts or print.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from specdecode.engine import Engine
from specdecode.models.build import LoadedModel
from specdecode.timing import interleaved_timings


@dataclass
class CostCurve:
    """Median seconds of one verification by draft length.

    Args:
        model: which model was timed.
        context: tokens in the cache while timing.
        seconds: ``seconds[k]`` for k = 0..K drafted tokens (k = 0 is a plain decode step).
        repeats: timings per k.
    """

    model: str
    context: int
    seconds: list[float]
    repeats: int

    @property
    def step_s(self) -> float:
        return self.seconds[0]

    @property
    def relative(self) -> list[float]:
        """v(k) = seconds[k] / seconds[0]."""
        return [s / self.seconds[0] for s in self.seconds]

    def to_dict(self) -> dict:
        return {"model": self.model, "context": self.context, "repeats": self.repeats,
                "step_ms": round(self.step_s * 1e3, 3), "verify_ms": [round(s * 1e3, 3) for s in self.seconds],
                "v": [round(v, 4) for v in self.relative]}


def measure_cost_curve(model: LoadedModel, prompt_ids: list[int], max_k: int = 16, repeats: int = 7) -> CostCurve:
    """Times verification of 0..max_k drafted tokens after prefilling ``prompt_ids``.

    Args:
        model: the model to time (the target, or a draft model to get its step cost).
        prompt_ids: the context.
        max_k: the longest draft timed.
        repeats: timings per draft length (the median is kept).
    """
    engine = Engine(model.model, model.tokenizer)
    with engine.verify_timer(prompt_ids) as verify_seconds:
        times = interleaved_timings(verify_seconds, range(max_k + 1), repeats, warmup=True)
    return CostCurve(model.source, len(prompt_ids), [statistics.median(t) for t in times], repeats)
