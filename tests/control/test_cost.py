"""The cost controller: online estimates, the choice of gamma, the off switch and its recovery."""

from __future__ import annotations

import pytest

from specdecode.control import CostGamma, memory_cap
from specdecode.control.estimates import PositionAcceptance, SharedEstimates, StepCosts, best_gamma, verify_shape
from control_helpers import ctx, record, step

VERIFY = 0.04  # seconds of a plain step in these scripts


def _run(controller, steps: int, accept_share: float, draft_per_token: float) -> list[int]:
    return [step(controller, accept_share, draft_per_token, VERIFY) for _ in range(steps)]


def test_position_acceptance_counts_judged_positions_only():
    a = PositionAcceptance(gamma_max=4, decay=1.0, strength=0.0)
    a.update(drafted=4, accepted=1)  # position 1 accepted, 2 rejected, 3 and 4 never judged
    a.update(drafted=4, accepted=4)
    assert a.seen == [2.0, 2.0, 1.0, 1.0]
    assert a.hits == [2.0, 1.0, 1.0, 1.0]
    assert a.cumulative(4) == pytest.approx([1.0, 0.5, 0.5, 0.5])
    a.update(drafted=0, accepted=0)  # a step without a draft teaches nothing
    assert a.seen == [2.0, 2.0, 1.0, 1.0]


def test_position_acceptance_starts_at_the_priors_and_forgets():
    a = PositionAcceptance(gamma_max=3, prior=0.6, later_prior=0.7)
    assert a.cumulative(3) == pytest.approx([0.6, 0.42, 0.294])
    for _ in range(50):
        a.update(drafted=3, accepted=0)
    assert a.cumulative(1)[0] < 0.05
    a.forget(0.0)
    assert a.cumulative(1)[0] == pytest.approx(0.6)


def test_later_positions_are_estimated_apart_from_the_first():
    # n-gram lookup: a draft often starts wrong, but once its first token is right it tends to go on.
    a = PositionAcceptance(gamma_max=6)
    for i in range(40):
        a.update(drafted=2, accepted=2 if i % 4 == 0 else 0)
    p1, p12 = a.cumulative(2)
    assert p1 == pytest.approx(0.25, abs=0.1)
    assert p12 / p1 > 0.8  # the second position's own evidence, not the first one's 0.25
    # Positions never reached lean on the later positions' estimate, not on the low first-position one.
    assert a.cumulative(6)[5] / a.cumulative(6)[4] > 0.8


def test_step_costs_seeded_from_a_measured_curve():
    c = StepCosts(gamma_max=8)
    c.update(drafted=2, draft_s=0.02, verify_s=0.05)
    c.seed([0.10, 0.103, 0.101, 0.11, 0.115, 0.118, 0.13, 0.15])  # k = 0..7; a dip at k = 2 (noise)
    assert c.base == pytest.approx(0.10) and c.draft_per_token is None and not c.ready
    assert c.verify_s(2) == pytest.approx(0.103)  # never below a shorter draft's verification
    assert c.verify_s(7) == pytest.approx(0.15)
    assert c.verify_s(8) == pytest.approx(0.17)  # past the measured k: the last slope
    with pytest.raises(ValueError, match="positive"):
        c.seed([0.1, 0.0])


def test_shared_gain_is_a_ratio_of_sums_that_ages_with_time():
    shared = SharedEstimates(gamma_max=8, gain_prior=1.2, prior_steps=3.0, gain_smoothing=0.1)
    shared.costs.update(drafted=0, draft_s=0.0, verify_s=0.1)  # a plain step: 0.1 s
    assert shared.gain == pytest.approx(1.2)  # the prior, before any drafting step
    for _ in range(60):
        shared.learn_gain(tokens=1, seconds=0.2)  # 1 token in 2 plain steps' time
        shared.learn_gain(tokens=5, seconds=0.2)  # 5 tokens in 2 plain steps' time
    # Tokens over time (newest step weighted 1, the one before 0.9), not a mean of the ratios 0.5 and 2.5.
    settled = (5 + 0.9 * 1) / (2 + 0.9 * 2)
    assert shared.gain == pytest.approx(settled, abs=0.01)
    for _ in range(30):
        shared.learn_gain()  # plain steps: the estimate stays, its weight fades
    assert shared.gain == pytest.approx(settled, abs=0.01)
    shared.learn_gain(tokens=1, seconds=0.4)  # one probe now counts for much of the evidence
    assert shared.gain < 1.0
    request = shared.request_acceptance()  # a request's own estimate starts from the long-run one
    assert request.prior == pytest.approx(shared.acceptance.pooled) and request.later_prior == shared.acceptance.later


def test_step_costs_learn_the_draft_cost_and_the_verification_curve():
    c = StepCosts(gamma_max=8, shape_smoothing=0.5)
    assert not c.ready
    for _ in range(40):
        c.update(drafted=4, draft_s=4 * 0.01, verify_s=0.05)
        c.update(drafted=0, draft_s=0.0, verify_s=0.04)
    assert c.ready
    assert c.draft_per_token == pytest.approx(0.01)
    assert c.verify_s(4) == pytest.approx(0.05, rel=0.05)
    assert c.verify_s(0) == pytest.approx(0.04, rel=0.05)
    # An unmeasured k follows the prior shape relative to the measured base.
    assert c.verify_s(8) == pytest.approx(c.base * verify_shape(8, c.verify_slope))
    assert verify_shape(0, 0.02) == 1.0 and verify_shape(3, 0.02) == pytest.approx(1.06)  # k = 0: a plain step
    assert c.step_s(3) == pytest.approx(3 * 0.01 + c.verify_s(3))


def test_host_hiccups_do_not_ratchet_the_price_of_drafts_that_seldom_run():
    """Plain and one-token steps at their usual times, a 10x hiccup among them now and then: the 3-token draft, never
    run since the curve was seeded, keeps its seeded price (it drifted 2.5x in 4500 real steps when a hiccup could
    move the curve's scale), and the k that ran keep theirs."""
    c = StepCosts(gamma_max=8)
    c.seed([0.0023, 0.0025, 0.0027, 0.0029])
    c.update(drafted=1, draft_s=1e-5, verify_s=0.0025)
    for i in range(3000):
        hiccup = 10.0 if i % 150 == 75 else 1.0
        c.update(drafted=i % 2, draft_s=1e-5, verify_s=(0.0023, 0.0025)[i % 2] * hiccup)
    assert c.verify_s(3) == pytest.approx(0.0029, rel=0.05)
    assert c.verify_s(0) == pytest.approx(0.0023, rel=0.05) and c.verify_s(1) == pytest.approx(0.0025, rel=0.05)


def test_best_gamma_maximises_expected_tokens_per_second():
    costs = StepCosts(gamma_max=8)
    costs.update(drafted=1, draft_s=0.3, verify_s=1.02)  # base 1.0, one draft token costs 0.3 of a step

    def brute(p: float) -> int:
        rates = [sum(p ** i for i in range(k + 1)) / costs.step_s(k) for k in range(9)]
        return max(range(9), key=lambda k: (rates[k], -k))

    for p in (0.0, 0.2, 0.5, 0.7, 0.9, 0.99):
        cumulative = [p ** i for i in range(1, 9)]
        assert best_gamma(cumulative, costs) == brute(p), p
    assert best_gamma([0.1] * 8, costs) == 0
    assert best_gamma([0.99 ** i for i in range(1, 9)], costs) == 8
    # With a margin, a draft predicted only slightly faster than plain decoding is not chosen.
    p = 0.35
    gain = sum(p ** i for i in range(2)) / costs.step_s(1) * costs.step_s(0)  # k = 1 vs plain
    assert 1.0 < gain < 1.05 and best_gamma([p], costs) == 1 and best_gamma([p], costs, margin=0.05) == 0


def test_cost_picks_zero_when_acceptance_is_low_and_more_when_it_is_high():
    low = CostGamma(gamma_max=8)
    assert _run(low, 30, accept_share=0.0, draft_per_token=0.3 * VERIFY)[-5:] == [0] * 5
    high = CostGamma(gamma_max=8)
    gammas = _run(high, 30, accept_share=1.0, draft_per_token=0.05 * VERIFY)
    assert gammas[-5:] == [8] * 5
    # A free drafter (n-gram lookup) pays even at modest acceptance; a costly one does not.
    cheap, costly = CostGamma(gamma_max=8), CostGamma(gamma_max=8)
    assert min(_run(cheap, 30, accept_share=0.5, draft_per_token=0.001 * VERIFY)[-5:]) > 0
    assert _run(costly, 30, accept_share=0.5, draft_per_token=0.9 * VERIFY)[-5:].count(0) >= 4


def test_off_switch_probes_and_recovers():
    c = CostGamma(gamma_max=8)
    draft = 0.3 * VERIFY
    gammas = _run(c, 20, accept_share=0.0, draft_per_token=draft)
    assert gammas[-1] == 0, gammas
    interval = c.off.interval(c.costs)
    # A probe's extra time is about 2 * 0.3 steps: spaced so that probes cost ~2% of the time off.
    assert interval == pytest.approx(0.62 / c.off.probe_overhead, abs=2)
    # Still bad: probes come every `interval` steps and are rejected; speculation stays off in between.
    gammas = _run(c, 3 * interval, accept_share=0.0, draft_per_token=draft)
    probes = [i for i, g in enumerate(gammas) if g > 0]
    assert len(probes) == 3 and all(gammas[i] == c.off.probe_gamma for i in probes)
    assert all(b - a == interval for a, b in zip(probes, probes[1:]))
    # The draft got good: the next probe is accepted and speculation turns back on for good.
    gammas = _run(c, interval + 10, accept_share=1.0, draft_per_token=draft)
    first = next(i for i, g in enumerate(gammas) if g > 0)
    assert first <= interval and all(g > 0 for g in gammas[first:]), gammas
    assert gammas[-1] >= 4


def test_catching_up_after_an_off_stretch_is_not_taken_for_draft_cost():
    c = CostGamma(gamma_max=8)
    _run(c, 20, accept_share=0.0, draft_per_token=0.3 * VERIFY)
    per_token = c.costs.draft_per_token
    while c.next_gamma(ctx()) == 0:
        c.update(record(0, 0, verify_s=VERIFY, requested=0))
    # The probe's draft also fed 60 missed tokens to the draft model: 10x the usual drafting time.
    c.update(record(2, 2, draft_s=20 * per_token, verify_s=VERIFY))
    assert c.costs.draft_per_token == pytest.approx(per_token)
    c.next_gamma(ctx())
    c.update(record(2, 2, draft_s=4 * per_token, verify_s=VERIFY))  # the next step's drafting is timed again
    assert c.costs.draft_per_token > per_token


def test_probes_of_a_free_drafter_come_often():
    c = CostGamma(gamma_max=8)
    _run(c, 20, accept_share=0.0, draft_per_token=0.0001 * VERIFY)
    assert c.off.interval(c.costs) == c.off.min_interval


def test_remaining_budget_caps_and_switches_off():
    c = CostGamma(gamma_max=8)
    _run(c, 30, accept_share=1.0, draft_per_token=0.05 * VERIFY)
    assert c.next_gamma(ctx(remaining=1)) == 0  # the last token comes from the target alone
    assert c.next_gamma(ctx(remaining=3)) == 2
    assert c.next_gamma(ctx(remaining=50)) == 8


def test_starts_with_start_gamma_until_costs_are_measured():
    c = CostGamma(gamma_max=8, start_gamma=3)
    assert c.next_gamma(ctx()) == 3
    c.update(record(0, 0, verify_s=VERIFY))  # nothing drafted (n-gram lookup found no match): no draft cost yet
    assert c.next_gamma(ctx()) == 3


@pytest.mark.parametrize("pressure, want", [(0.0, 8), (0.8, 8), (0.9, 4), (0.95, 2), (0.99, 1), (1.0, 1)])
def test_memory_cap_shortens_drafts_near_the_budget(pressure, want):
    assert memory_cap(ctx(context_len=100, cache_fill=pressure), 8) == want
    assert memory_cap(ctx(context_len=int(pressure * 1000), max_context=1000), 8) == want


def test_cost_drafts_less_under_memory_pressure():
    c = CostGamma(gamma_max=8)
    _run(c, 30, accept_share=1.0, draft_per_token=0.05 * VERIFY)
    assert c.next_gamma(ctx(cache_fill=0.5)) == 8
    assert c.next_gamma(ctx(cache_fill=0.95)) == 2


def test_in_a_batch_a_draft_also_pays_for_slowing_the_others():
    """Forwards cost 10 ms up to 6 rows, then 6 ms per 6 rows more (a second pass over the weights). Alone,
    a draft at acceptance 0.6 fills the cheap rows; beside 5 sequences that already use 5 rows, the same
    draft would push the forward past 6 rows and slow 5 other tokens too: off."""
    costs = StepCosts(gamma_max=8, max_rows=16)
    costs.seed([0.010 if rows <= 6 else 0.010 + 0.006 * ((rows - 1) // 6) for rows in range(1, 17)])
    costs.draft_per_token = 1e-5
    cumulative = [0.6 ** i for i in range(1, 9)]
    assert best_gamma(cumulative, costs) == 5
    assert best_gamma(cumulative, costs, others_rows=5, others_tokens=5.0) == 0
    assert best_gamma(cumulative, costs, others_rows=3, others_tokens=3.0) == 2  # what is left of the cheap rows
    assert costs.verify_s(15) == pytest.approx(0.022) and costs.step_s(2, 3) == pytest.approx(2e-5 + 0.010)


def test_rows_past_the_curve_cost_its_mean_row_and_teach_it_nothing():
    # Drift fixed: past max_rows (prompt rows beside decoding ones) the curve was read at its last point, so a
    # draft there looked free; and a 256-row prompt chunk's forward was learnt as the curve's last point.
    costs = StepCosts(gamma_max=8, max_rows=16)
    costs.seed([0.010 + 0.002 * (rows - 1) for rows in range(1, 17)])
    costs.draft_per_token = 1e-5
    assert costs.verify_s(20) == pytest.approx(0.010 + 0.002 * 20)
    longer = StepCosts(gamma_max=8, max_rows=24)  # the same line, measured that far
    longer.seed([0.010 + 0.002 * (rows - 1) for rows in range(1, 25)])
    longer.draft_per_token = 1e-5
    cumulative = [0.6 ** i for i in range(1, 9)]
    chosen = best_gamma(cumulative, costs, others_rows=15, others_tokens=1.0)
    assert chosen == best_gamma(cumulative, longer, others_rows=15, others_tokens=1.0) < 8  # was 8: rows free
    base, shape = costs.base, list(costs.shape)
    costs.update(drafted=0, draft_s=0.0, verify_s=0.5, others=255)
    assert (costs.base, costs.shape) == (base, shape)


def test_in_a_batch_probes_are_spaced_by_the_sequences_sharing_the_step():
    # A probe slows every sequence's step and each of them probes: four sharers, four times the spacing (and
    # its bound); a lone sequence's spacing is what it was.
    c = CostGamma(gamma_max=8)
    c.costs.seed([0.010 * (1 + 0.1 * rows) for rows in range(1, 17)])
    c.costs.draft_per_token = 0.002
    alone = c.off.interval(c.costs)
    assert alone == c.off.interval(c.costs, ctx()) and c.off.min_interval < alone < c.off.max_interval
    one = c.off.interval(c.costs, ctx(others_rows=3))
    four = c.off.interval(c.costs, ctx(others_rows=3, others_tokens=3.0))
    assert 4 * one - 3 <= four <= 4 * one
    c.costs.draft_per_token = 0.05  # costly probes: the bound, which grows with the sharers too
    assert c.off.interval(c.costs) == c.off.max_interval
    assert c.off.interval(c.costs, ctx(others_rows=3, others_tokens=3.0)) == 4 * c.off.max_interval


def test_a_step_curve_is_step_s_at_every_k_inside_and_past_the_measured_rows():
    costs = StepCosts(gamma_max=8, max_rows=12)
    costs.seed([0.010, 0.011, 0.0125, 0.013, 0.017, 0.018, 0.018, 0.019])  # a jump at the 5th row; 8 rows timed
    costs.draft_per_token = 0.0007
    costs.update(drafted=2, draft_s=0.002, verify_s=0.014, others=3)
    for others in (0, 3, 9, 11, 15):
        for k_max in (0, 1, 8, 20):
            assert costs.step_curve(k_max, others) == [costs.step_s(k, others) for k in range(k_max + 1)]


def test_kept_step_curves_and_acceptance_follow_every_change_of_what_they_are_made_of():
    """step_curve and cumulative keep their answers for the next sequence of the step: a learnt step, a new seed, a
    changed draft cost or new evidence gives the new answer, never the kept one."""
    costs = StepCosts(gamma_max=8, max_rows=12)
    costs.seed([0.010, 0.011, 0.0125, 0.013, 0.017, 0.018, 0.018, 0.019])
    costs.draft_per_token = 0.0007
    fresh = lambda k_max, others: [costs.step_s(k, others) for k in range(k_max + 1)]  # noqa: E731
    kept = costs.step_curve(4, 3)
    assert costs.step_curve(4, 3) is kept  # the same step: kept
    costs.update(drafted=2, draft_s=0.002, verify_s=0.020, others=3)
    assert costs.step_curve(4, 3) == fresh(4, 3) != kept
    kept = costs.step_curve(4, 3)
    costs.draft_per_token = 0.002
    assert costs.step_curve(4, 3) == fresh(4, 3) != kept
    costs.seed([0.020, 0.021, 0.022, 0.023, 0.030, 0.031, 0.032, 0.033])
    costs.draft_per_token = 0.002
    assert costs.step_curve(4, 3) == fresh(4, 3)
    acceptance = PositionAcceptance(gamma_max=6)
    before = acceptance.cumulative(6)
    assert acceptance.cumulative(3) == before[:3]
    acceptance.update(drafted=4, accepted=1)
    after = acceptance.cumulative(6)
    assert after[0] > before[0] and after[1] < before[1]  # the first drafted token kept, the second not
    acceptance.forget(0.0)  # no evidence left: back to the priors
    assert acceptance.cumulative(6) == pytest.approx(before)


def test_a_batch_step_teaches_the_curve_its_level_not_its_shape():
    # Drift fixed: at c = 8 every step runs 8 rows and seldom 9 or 10, and no one-row step pins base against the
    # shape; the 8-row point took up the contexts' growth and the 9th row came to look free (a one-token draft then
    # "paid" where it cost 9% of the step). A batch's steps now move base alone; a lone sequence's still shape it.
    seeded = [0.0033 * s for s in (1.0, 1.066, 1.111, 1.169, 1.332, 1.434, 1.614, 1.781, 2.016, 2.115)]
    costs = StepCosts(gamma_max=8, max_rows=10)
    costs.seed(seeded)
    costs.draft_per_token = 1e-5
    shape = list(costs.shape)
    for step in range(200):  # contexts grow: each step slower than at warm-up, and every sequence learns it
        rows = 9 if step % 10 == 0 else 8
        for _ in range(8):
            costs.update(drafted=0, draft_s=0.0, verify_s=seeded[rows - 1] * (1.6 + step / 400), others=rows - 1)
    assert costs.shape == shape
    assert costs.verify_s(7) == pytest.approx(seeded[7] * (1.6 + 199 / 400), rel=0.05)  # the level follows
    assert costs.step_s(1, 7) / costs.step_s(0, 7) > 1.1  # the 9th row's price stays the kernel's
    costs.update(drafted=3, draft_s=3e-5, verify_s=3 * seeded[3], others=0)  # alone: the shape learns
    assert costs.shape[3] > shape[3]
