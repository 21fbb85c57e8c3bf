"""The adaptive controller: cost's on/off decision with draft lengths set by confidence and cost."""

from __future__ import annotations

from specdecode.control import AdaptiveGamma
from specdecode.control.model_file import AcceptanceModel, feature_names
from control_helpers import ctx, step

NAMES = feature_names(("top1", "entropy"))
MODEL = AcceptanceModel("layerskip", NAMES, (10.0,) + (0.0,) * (len(NAMES) - 1), -5.0)
VERIFY = 0.04


def _warm(c: AdaptiveGamma, draft_per_token: float, accept_share: float = 1.0, steps: int = 20) -> None:
    for _ in range(steps):
        step(c, accept_share, draft_per_token, VERIFY)


def _length(c: AdaptiveGamma, top1: float, remaining: int = 100) -> int:
    k = c.next_gamma(ctx(remaining=remaining))
    for i in range(k):
        if c.stop(i, (top1, 0.0)):
            return i + 1
    return k


def test_without_a_model_it_is_the_cost_controller():
    c = AdaptiveGamma(None, gamma_max=8)
    assert not c.early_stop
    _warm(c, 0.3 * VERIFY, accept_share=0.0)
    assert c.next_gamma(ctx()) == 0


def test_switches_off_when_drafts_are_rejected_and_back_on_when_accepted():
    c = AdaptiveGamma(MODEL, gamma_max=8)
    _warm(c, 0.3 * VERIFY, accept_share=0.0)
    assert c.next_gamma(ctx()) == 0
    assert not c.stop(0, (1.0, 0.0))  # off: nothing to stop
    _warm(c, 0.3 * VERIFY, accept_share=1.0, steps=c.cost.off.interval(c.cost.costs) + 5)
    assert c.next_gamma(ctx()) == 8


def test_confident_drafts_run_longer_and_cheap_drafts_run_longer():
    cheap, costly = AdaptiveGamma(MODEL), AdaptiveGamma(MODEL)
    _warm(cheap, 0.01 * VERIFY)
    _warm(costly, 0.4 * VERIFY)
    assert _length(cheap, 0.999) == 8
    assert _length(costly, 0.999) == 8
    assert _length(costly, 0.7) < _length(cheap, 0.7)
    assert _length(costly, 0.6) < _length(costly, 0.7)
    assert _length(costly, 0.3) == 1  # the first token is drafted anyway; it stops right after


def test_respects_the_budget_and_memory():
    c = AdaptiveGamma(MODEL)
    _warm(c, 0.01 * VERIFY)
    assert c.next_gamma(ctx(remaining=3)) == 2
    assert c.next_gamma(ctx(remaining=1)) == 0
    assert c.next_gamma(ctx(cache_fill=0.95)) == 2
