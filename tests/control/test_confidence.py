"""The confidence controller: early stopping from the draft's signals, and its online calibration."""

from __future__ import annotations

import pytest

from specdecode.control import ConfidenceGamma
from specdecode.control.confidence import CalibratedAcceptance
from specdecode.control.model_file import AcceptanceModel, feature_names
from control_helpers import ctx, record

# A model that reads only top-1 probability: logit = 10 * (top1 - 0.5), so p(top1) is 0.5 at top1 = 0.5.
NAMES = feature_names(("top1", "entropy"))
MODEL = AcceptanceModel("layerskip", NAMES, (10.0,) + (0.0,) * (len(NAMES) - 1), -5.0)


def _draft(controller, top1s) -> int:
    """Tokens drafted before the controller stops (all of them when it never does)."""
    controller.next_gamma(ctx())
    for i, top1 in enumerate(top1s):
        if controller.stop(i, (top1, 0.0)):
            return i + 1
    return len(top1s)


def test_stops_once_a_further_token_is_unlikely_to_be_accepted():
    c = ConfidenceGamma(MODEL, gamma_max=8, threshold=0.4)
    assert c.early_stop and c.next_gamma(ctx()) == 8
    assert _draft(c, [0.99] * 8) == 8
    # p = 0.5 at the third token: 0.99^2 * 0.5 * 0.5 < 0.4, stop there (that token is kept).
    assert _draft(c, [0.99, 0.99, 0.5, 0.99, 0.99]) == 3
    # Confident tokens still add up: P_i * p_i falls below 0.4 after a few at p = 0.82.
    p = 1 / (1 + 2.718281828 ** -(10 * (0.66 - 0.5)))
    n = next(i for i in range(1, 9) if p ** (i + 1) < 0.4)
    assert _draft(c, [0.66] * 8) == n


def test_threshold_sets_the_draft_length():
    lengths = [_draft(ConfidenceGamma(MODEL, threshold=t), [0.65] * 8) for t in (0.1, 0.4, 0.8)]
    # p = 0.82 per token; after token i (0-based) a further one is accepted with p^(i+2): below 0.4 from
    # i = 3 (4 tokens drafted), below 0.8 from i = 0 (1 token).
    assert lengths == [8, 4, 1]


def test_online_calibration_corrects_an_overconfident_model():
    cal = CalibratedAcceptance(MODEL)
    before = cal.predict((0.9, 0.0), 0, ctx())
    assert before > 0.95
    for _ in range(300):  # the drafter says 0.9 but its first token is always rejected
        cal.learn(record(2, 0, signals=[(0.9, 0.0), (0.9, 0.0)]))
    assert cal.predict((0.9, 0.0), 0, ctx()) < 0.3
    # Only judged tokens teach: the second token of those steps was never judged.
    cal2 = CalibratedAcceptance(MODEL)
    cal2.learn(record(2, 2, signals=[(0.9, 0.0), (0.9, 0.0)]))
    assert cal2.shift > 0


def test_drafts_shorter_near_the_memory_budget():
    c = ConfidenceGamma(MODEL, gamma_max=8)
    assert c.next_gamma(ctx(cache_fill=0.95)) == 2


def test_update_learns_from_the_record():
    c = ConfidenceGamma(MODEL)
    c.next_gamma(ctx())
    c.update(record(1, 0, signals=[(0.99, 0.0)]))
    assert c.acceptance.shift == pytest.approx(-0.05 * MODEL.predict((0.99, 0.0, 1.0, 0, 0, 0)), rel=1e-6)
