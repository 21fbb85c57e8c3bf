"""The agreement controller (the original document's formula) and the fixed gamma."""

from __future__ import annotations

import pytest

from specdecode.control import AgreementGamma, FixedGamma, agreement_gamma
from control_helpers import ctx, record


@pytest.mark.parametrize("acceptance, gamma_max, want", [
    (0.0, 8, 1),  # floor(1 / 1) = 1: never below one
    (0.3, 8, 1),
    (0.5, 8, 2),  # 1 / 0.5
    (0.75, 8, 4),
    (0.9, 8, 8),  # 1 / 0.1 = 10, capped
    (0.9, 16, 10),
    (0.99, 16, 16),
    (1.0, 8, 8),  # the division by zero is capped at gamma_max
    (1.0, 3, 3),
    (0.5, 1, 1),
])
def test_agreement_gamma_values(acceptance, gamma_max, want):
    assert agreement_gamma(acceptance, gamma_max) == want


def test_agreement_gamma_is_monotone_bounded_and_at_least_one():
    for gamma_max in (1, 4, 8, 64):
        values = [agreement_gamma(i / 100, gamma_max) for i in range(101)]
        assert all(1 <= v <= gamma_max for v in values)
        assert values == sorted(values)
        assert values[-1] == gamma_max


def test_agreement_controller_moves_down_after_rejections_and_up_after_acceptances():
    c = AgreementGamma(gamma_max=8)
    assert c.next_gamma(ctx()) == 4  # the documented starting point (acceptance 0.75)
    for _ in range(10):
        c.update(record(4, 0))
    assert c.next_gamma(ctx()) == 1 and c.acceptance < 0.1
    for _ in range(30):
        c.update(record(4, 4))
    assert c.next_gamma(ctx()) == 8
    assert c.acceptance > 0.99


def test_agreement_controller_follows_the_smoothed_rate():
    c = AgreementGamma(gamma_max=8, smoothing=0.5, acceptance=0.0)
    # 2 accepted then a rejection: 2 of the 3 judged tokens passed (the 4th was never judged).
    c.update(record(4, 2))  # 0 + 0.5 * (2/3 - 0) = 1/3
    assert c.acceptance == pytest.approx(1 / 3)
    c.update(record(2, 2))  # 1/3 + 0.5 * (1 - 1/3) = 2/3
    assert c.acceptance == pytest.approx(2 / 3)
    assert c.next_gamma(ctx()) == agreement_gamma(2 / 3, 8) == 3


def test_agreement_controller_ignores_steps_without_a_draft_and_never_stops_early():
    c = AgreementGamma()
    c.update(record(0, 0))
    assert c.acceptance == 0.75
    assert not c.early_stop and not c.stop(0, (0.0, 9.0))


def test_fixed_gamma_never_moves():
    for gamma in (0, 3):
        c = FixedGamma(gamma)
        c.update(record(3, 0))
        c.update(record(3, 3))
        assert c.next_gamma(ctx(remaining=2)) == gamma  # the engine, not the controller, caps at the budget
        assert not c.early_stop and not c.stop(0, (0.0,))
