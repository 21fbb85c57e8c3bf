"""Gamma controllers."""

from __future__ import annotations

import pytest

from specdecode.control import AgreementGamma, FixedGamma, agreement_gamma, make_controller


@pytest.mark.parametrize("acceptance, gamma_max, want", [
    (0.0, 8, 1),
    (0.3, 8, 1),
    (0.5, 8, 2),
    (0.75, 8, 4),
    (0.9, 8, 8),
    (0.9, 16, 10),
    (0.99, 16, 16),
    (1.0, 8, 8),
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
    start = c.next_gamma()
    assert start == 4  # the documented starting point (acceptance 0.75)
    for _ in range(10):
        c.update(drafted=4, accepted=0)
    low = c.next_gamma()
    assert low == 1 and c.acceptance < 0.1
    for _ in range(30):
        c.update(drafted=4, accepted=4)
    assert c.next_gamma() == 8
    assert c.acceptance > 0.99


def test_agreement_controller_follows_the_smoothed_rate():
    c = AgreementGamma(gamma_max=8, smoothing=0.5, acceptance=0.0)
    # 2 accepted then a rejection: 2 of the 3 judged tokens passed (the 4th was never judged).
    c.update(drafted=4, accepted=2)  # 0 + 0.5 * (2/3 - 0) = 1/3
    assert c.acceptance == pytest.approx(1 / 3)
    c.update(drafted=2, accepted=2)  # 1/3 + 0.5 * (1 - 1/3) = 2/3
    assert c.acceptance == pytest.approx(2 / 3)
    assert c.next_gamma() == agreement_gamma(2 / 3, 8) == 3


def test_agreement_controller_ignores_steps_without_a_draft():
    c = AgreementGamma()
    c.update(drafted=0, accepted=0)
    assert c.acceptance == 0.75


def test_fixed_gamma_never_moves():
    for gamma in (0, 3):
        c = FixedGamma(gamma)
        c.update(drafted=3, accepted=0)
        c.update(drafted=3, accepted=3)
        assert c.next_gamma() == gamma


def test_make_controller():
    agreement = make_controller("agreement", gamma_max=6)
    assert isinstance(agreement, AgreementGamma) and agreement.gamma_max == 6
    fixed = make_controller(5, gamma_max=6)
    assert isinstance(fixed, FixedGamma) and fixed.next_gamma() == 5
    assert make_controller(0, gamma_max=6).next_gamma() == 0
