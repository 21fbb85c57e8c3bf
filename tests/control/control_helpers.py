"""Builders for controller inputs: contexts, step records and scripted step sequences."""

from __future__ import annotations

from specdecode.control import StepContext, StepRecord


def ctx(remaining: int = 100, context_len: int = 100, max_context: int = 8192, cache_fill: float | None = None,
        kv: str = "bfloat16", others_rows: int = 0, others_tokens: float = 0.0) -> StepContext:
    return StepContext(remaining=remaining, context_len=context_len, max_context=max_context, cache_fill=cache_fill,
                       kv=kv, others_rows=others_rows, others_tokens=others_tokens)


def record(drafted: int, accepted: int, draft_s: float = 0.0, verify_s: float = 0.04, requested: int | None = None,
           signals=(), context: StepContext | None = None, others_rows: int = 0) -> StepRecord:
    return StepRecord(ctx=context or ctx(), requested=drafted if requested is None else requested, drafted=drafted,
                      accepted=accepted, draft_s=draft_s, verify_s=verify_s, signals=list(signals),
                      others_rows=others_rows)


def step(controller, accept_share: float, draft_per_token: float, verify_base: float = 0.04,
         verify_slope: float = 0.02, context: StepContext | None = None) -> int:
    """Runs one scripted step: asks for gamma, accepts the first round(share * k) tokens, reports costs
    that follow draft_per_token * k and verify_base * (1 + slope * max(k, 1)). Returns the gamma asked for."""
    k = controller.next_gamma(context or ctx())
    accepted = round(accept_share * k)
    controller.update(record(k, accepted, draft_per_token * k, verify_base * (1 + verify_slope * max(k, 1)),
                             context=context))
    return k
