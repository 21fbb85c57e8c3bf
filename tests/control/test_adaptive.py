"""The adaptive controller: cost's on/off decision with draft lengths set by confidence and cost."""

from __future__ import annotations

import pytest

from specdecode.control import AdaptiveGamma, controller_factory
from specdecode.control.confidence import CalibratedAcceptance
from specdecode.control.cost import OffSwitch
from specdecode.control.estimates import PositionAcceptance, best_gamma
from specdecode.control.model_file import AcceptanceModel, feature_names
from control_helpers import ctx, record, step

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
    assert c.shared.gain < 1.0 and c.next_gamma(ctx()) == 0
    assert not c.early_stop and not c.stop(0, (1.0, 0.0))  # off: nothing to stop
    # Probes (full-length drafts, stopped by confidence) measure drafting again; accepted ones turn it on.
    asked = [step(c, 1.0, 0.3 * VERIFY, VERIFY) for _ in range(4 * c.off.max_interval)]
    assert any(0 < k for k in asked[:c.off.max_interval + 1])
    assert c.shared.gain > 1.0 and c.next_gamma(ctx()) == 8


def test_one_slow_first_draft_does_not_hold_drafting_off():
    # An early draft ran 20x slow (a host's hiccup): drafting goes off, and the draft cost learnt from it is ~7x
    # too high. While off only probes draft, each after plain steps, so its time holds a catch-up (here one more
    # token's drafting) and is not timed as the draft cost: priced at the inflated estimate, every probe would read
    # slower than plain decoding and drafting would stay off. Its measured time bounds its cost from above.
    c = AdaptiveGamma(MODEL, gamma_max=8)
    c.shared.costs.seed([VERIFY] * 9)
    true_per_token = 0.3 * VERIFY
    for slow in (1, 1, 20):
        k = c.next_gamma(ctx())
        c.update(record(k, k, slow * true_per_token * k, VERIFY))
    assert c.shared.gain < 1.0 and c.next_gamma(ctx()) == 0
    assert c.cost.costs.draft_per_token > 5 * true_per_token
    drafted, before = [], True
    for _ in range(4 * c.off.max_interval):
        k = c.next_gamma(ctx())
        c.update(record(k, k, true_per_token * (k + (0 if before else 1)), VERIFY, requested=k))
        drafted.append(k)
        before = k > 0
    assert c.shared.gain > 1.0 and c.cost.costs.draft_per_token < 2 * true_per_token
    assert drafted[-20:].count(0) <= 1  # on again (a re-timing plain step at most)


def test_on_off_follows_measured_speed_not_the_cost_model():
    # Confident stopping can make drafting pay where per-position acceptance says it would not
    # (the Qwen pair): the measured speed of drafting steps decides.
    c = AdaptiveGamma(MODEL, gamma_max=8)
    _warm(c, 0.3 * VERIFY, accept_share=1.0)
    c.cost.acceptance = PositionAcceptance(8, prior=0.1, later_prior=0.1)
    assert c.cost.next_gamma(ctx()) == 0
    for _ in range(40):
        c.shared.learn_gain(tokens=3, seconds=2 * VERIFY)  # 3 tokens in 2 plain steps' time
    c.shared.learn_plain(VERIFY)  # a plain step timed lately: no re-timing step due
    assert c.shared.gain > 1.3 and c.next_gamma(ctx()) == 8
    for _ in range(40):
        c.shared.learn_gain(tokens=3, seconds=4 * VERIFY)
    c.shared.learn_plain(VERIFY)
    assert c.shared.gain < 1.0 and c.next_gamma(ctx()) == 0


def test_a_new_request_starts_from_what_earlier_ones_measured():
    factory = controller_factory("adaptive", 8, "layerskip", ("top1", "entropy"))
    first = factory()
    first.acceptance = CalibratedAcceptance(MODEL)  # the scripted steps' signals are the test model's
    _warm(first, 0.9 * VERIFY, accept_share=0.5)
    second = factory()
    assert second.shared is first.shared and second.cost.costs.ready
    assert second.next_gamma(ctx()) == 0  # drafting did not pay before: off from the first step


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


def test_near_free_drafts_stop_by_confidence_too():
    # n-gram lookup: a drafted token costs only its verification row, yet a weak proposal is cut short.
    free = AdaptiveGamma(MODEL)
    _warm(free, 0.0)
    assert free.next_gamma(ctx()) == 8 and free.early_stop
    assert _length(free, 0.3) == 1
    assert _length(free, 0.999) == 8


def _run(c: AdaptiveGamma, steps: int, draft_s: float, verify_1: float, plain_s: float = VERIFY) -> list[int]:
    """Scripted steps: every draft stops after one token, which is accepted (2 tokens per drafting step);
    a drafting step costs draft_s + verify_1, a plain step plain_s. Returns the tokens drafted per step."""
    drafted = []
    for _ in range(steps):
        k = c.next_gamma(ctx())
        n = min(k, 1)
        c.update(record(n, n, draft_s * n, verify_1 if n else plain_s, requested=k))
        drafted.append(n)
    return drafted


def test_drafting_speed_is_judged_against_measured_plain_steps():
    # The warm-up curve says verifying a token costs nothing extra (v(1) = 1); in fact a plain step takes
    # 0.04 s and a drafting step 0.035 + 0.05 s for 2 tokens: 0.94x plain decoding. Judged in the curve's
    # plain step (inferred from drafting steps: 0.05 s) it would read 1.18x and stay on.
    slow = AdaptiveGamma(MODEL)
    slow.shared.costs.seed([VERIFY] * 9)
    drafted = _run(slow, 300, draft_s=0.035, verify_1=0.05)
    assert slow.shared.plain_s == pytest.approx(VERIFY) and slow.shared.gain < 1.0
    assert sum(drafted[-200:]) < 20  # off but for probes
    # Cheap drafts (0.01 + 0.05 s for 2 tokens: 1.33x) stay on, with a plain step now and then to re-time one.
    fast = AdaptiveGamma(MODEL)
    fast.shared.costs.seed([VERIFY] * 9)
    drafted = _run(fast, 300, draft_s=0.01, verify_1=0.05)
    assert fast.shared.gain > 1.2
    assert 200 / (fast.refresh + 1) - 1 <= drafted[-200:].count(0) <= 200 / fast.refresh + 1


def _second_pass_costs(c: AdaptiveGamma) -> None:
    """Forwards cost 10 ms up to 6 rows, then 6 ms more per 6 rows (a second pass over the weights)."""
    c.shared.costs.seed([0.010 if rows <= 6 else 0.010 + 0.006 * ((rows - 1) // 6) for rows in range(1, 17)])
    c.shared.costs.draft_per_token = 1e-5


def test_in_a_batch_it_drafts_where_the_whole_step_gains():
    # Alone, drafting measurably pays; beside 5 sequences that fill the cheap rows a draft would slow 5 other
    # tokens too (off); beside 3, what is left of the cheap rows pays (on).
    c = AdaptiveGamma(MODEL, gamma_max=8)
    _warm(c, 0.01 * VERIFY, accept_share=1.0)
    _second_pass_costs(c)
    c.cost.acceptance = PositionAcceptance(8, prior=0.6, later_prior=0.6)
    assert c.shared.gain > 1.0 and c.next_gamma(ctx()) == 8
    assert c.next_gamma(ctx(others_rows=5, others_tokens=5.0)) == 0
    assert c.next_gamma(ctx(others_rows=3, others_tokens=3.0)) == 8 and c.early_stop  # its length: by confidence


def test_in_a_batch_a_draft_must_gain_the_margin():
    # Drift fixed: in a batch `adaptive` took any draft its model priced above break-even; through `serve` at c = 8
    # such drafts (a 0.9 row for 0.4 token) ran at break-even less speculation's own bookkeeping: 0.90-0.95x plain.
    c = AdaptiveGamma(MODEL, gamma_max=8)
    _warm(c, 0.01 * VERIFY, accept_share=1.0)
    c.shared.costs.seed([0.010 * (1 + 0.1 * (rows - 1)) for rows in range(1, 17)])  # each row a tenth of a step
    c.shared.costs.draft_per_token = 1e-6
    busy = ctx(others_rows=7, others_tokens=7.0)
    c.cost.acceptance = PositionAcceptance(8, prior=0.64, later_prior=0.64)
    assert best_gamma(c.cost.acceptance.cumulative(8), c.shared.costs, 0.0, 7, 7.0) > 0  # a 2% gain...
    assert c.next_gamma(busy) == 0  # ...within the margin: off
    c.cost.acceptance = PositionAcceptance(8, prior=0.95, later_prior=0.95)
    assert c.next_gamma(busy) > 0


def test_a_shared_steps_time_is_not_taken_for_drafting_speed():
    # A forward shared with others times their rows too: only steps run alone teach drafting's measured speed.
    c = AdaptiveGamma(MODEL, gamma_max=8)
    _warm(c, 0.01 * VERIFY, accept_share=1.0)
    gain, plain = c.shared.gain, c.shared.plain_s
    busy = ctx(others_rows=7, others_tokens=7.0)
    for _ in range(20):
        c.next_gamma(busy)
        c.update(record(4, 0, verify_s=5 * VERIFY, context=busy, others_rows=7))
        c.next_gamma(busy)
        c.update(record(0, 0, verify_s=4 * VERIFY, requested=0, context=busy, others_rows=7))
    assert (c.shared.gain, c.shared.plain_s) == (gain, plain)
    c.next_gamma(ctx())
    c.update(record(4, 0, verify_s=2 * VERIFY))  # alone, a rejected draft in two plain steps' time: counted
    assert c.shared.gain < gain


def test_in_a_batch_it_probes_as_cost_does_where_alone_it_probes_more():
    # Alone, on/off goes by measured speed, which needs probes 5% of the time; in a batch on/off goes by cost's
    # model, and a probe slows every sequence's step: cost's 2%. At c = 8 the 5% was about the whole loss (history).
    def probes(others: int, steps: int = 2000) -> int:
        c = AdaptiveGamma(MODEL, gamma_max=8)
        _warm(c, 0.01 * VERIFY, accept_share=1.0)
        c.shared.costs.seed([0.010 * (1 + 0.1 * (rows - 1)) for rows in range(1, 17)])
        c.shared.costs.draft_per_token = 1e-6
        c.cost.acceptance = PositionAcceptance(8, prior=0.05, later_prior=0.05)  # drafts never pay: off
        for _ in range(200):  # (alone: drafting measured slower than plain)
            c.shared.learn_gain(1, 10 * VERIFY)
        c.shared.learn_plain(VERIFY)  # (and a plain step timed since)
        at = ctx(others_rows=others, others_tokens=float(others))
        return sum(c.next_gamma(at) > 0 for _ in range(steps))

    costs = AdaptiveGamma(MODEL, gamma_max=8).shared.costs
    costs.seed([0.010 * (1 + 0.1 * (rows - 1)) for rows in range(1, 17)])
    costs.draft_per_token = 1e-6
    busy = ctx(others_rows=7, others_tokens=7.0)
    spacing = OffSwitch().interval(costs, busy)
    assert OffSwitch(probe_overhead=0.05, max_interval=32).interval(costs, busy) < spacing
    assert probes(7) == 2000 // spacing  # one probe per cost's spacing
    assert probes(0) > 0  # alone it probes too (by its own, denser spacing)


def test_in_a_batch_a_draft_its_own_tokens_do_not_pay_for_is_dropped_once_seen():
    # Per-position acceptance (0.95) said a draft pays beside 3 others, so it was drafted; its first token's
    # confidence (2%) then stopped it at one row, which costs a tenth of a step for 0.02 of a token: keep() drops it.
    # A confident draft keeps all its tokens, and alone keep() leaves every draft whole.
    c = AdaptiveGamma(MODEL, gamma_max=8)
    _warm(c, 0.01 * VERIFY, accept_share=1.0)
    c.shared.costs.seed([0.010 * (1 + 0.1 * (rows - 1)) for rows in range(1, 17)])  # each row a tenth of a step
    c.shared.costs.draft_per_token = 1e-6
    c.cost.acceptance = PositionAcceptance(8, prior=0.95, later_prior=0.95)
    busy = ctx(others_rows=3, others_tokens=3.0)
    assert c.next_gamma(busy) == 8 and c.early_stop
    assert c.stop(0, (0.1, 0.0))  # an unlikely first token: stop after it
    assert c.keep(1) == 0
    assert c.next_gamma(busy) == 8
    n = next(i + 1 for i in range(8) if c.stop(i, (0.99, 0.0)) or i == 7)
    assert n >= 2 and c.keep(n) == n
    assert c.next_gamma(ctx()) == 8
    c.stop(0, (0.1, 0.0))  # alone: confidence stops drafts, keep() cuts nothing
    assert c.keep(1) == 1
