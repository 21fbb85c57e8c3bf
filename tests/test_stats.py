"""Request counters and the expected-tokens / speedup formulas."""

from __future__ import annotations

import json

import pytest

from specdecode.stats import RequestStats, expected_tokens_per_step, predicted_speedup


@pytest.mark.parametrize("gamma", [1, 4, 7])
def test_expected_tokens_edges(gamma):
    assert expected_tokens_per_step(0.0, gamma) == 1.0
    assert expected_tokens_per_step(1.0, gamma) == gamma + 1
    # Continuous as a -> 1, and the closed form equals the geometric sum 1 + a + ... + a^k.
    assert expected_tokens_per_step(1 - 1e-9, gamma) == pytest.approx(gamma + 1, rel=1e-6)
    for a in (0.2, 0.5, 0.8):
        assert expected_tokens_per_step(a, gamma) == pytest.approx(sum(a ** i for i in range(gamma + 1)))


def test_expected_tokens_increases_with_acceptance_and_gamma():
    assert expected_tokens_per_step(0.5, 4) < expected_tokens_per_step(0.6, 4)
    assert expected_tokens_per_step(0.5, 4) < expected_tokens_per_step(0.5, 5)


def test_predicted_speedup_formula():
    # E / (k c + v): with a = 0.5, k = 2: E = 1.75; c = 0.1, v = 1.2 -> 1.75 / 1.4 = 1.25.
    assert predicted_speedup(0.5, 2, 0.1, 1.2) == pytest.approx(1.25)
    assert predicted_speedup(0.0, 4, 0.0, 1.0) == pytest.approx(1.0)
    assert predicted_speedup(1.0, 4, 0.0, 1.0) == pytest.approx(5.0)
    assert predicted_speedup(1.0, 4, 0.25, 1.0) == pytest.approx(2.5)


def test_record_step_counters_and_positions():
    s = RequestStats(prompt_tokens=7)
    s.record_step(drafted=3, accepted=3, emitted=4)
    s.record_step(drafted=4, accepted=1, emitted=2)
    s.record_step(drafted=0, accepted=0, emitted=1)
    s.record_step(drafted=2, accepted=0, emitted=1)
    assert (s.target_forwards, s.drafted_tokens, s.accepted_tokens, s.tokens_generated) == (4, 9, 4, 8)
    assert s.drafted_by_position == [3, 3, 2, 1]
    assert s.accepted_by_position == [2, 1, 1, 0]
    assert s.acceptance_by_position == pytest.approx([2 / 3, 1 / 3, 1 / 2, 0.0])
    assert s.acceptance_rate == pytest.approx(4 / 9)
    assert s.mean_accepted_length == pytest.approx(8 / 4)
    assert s.mean_gamma == pytest.approx(9 / 4)


def test_empty_stats_derive_zeros():
    s = RequestStats()
    assert s.acceptance_rate == 0.0 and s.mean_accepted_length == 0.0 and s.mean_gamma == 0.0
    assert s.acceptance_by_position == [] and s.tokens_per_s == 0.0
    assert s.predicted_speedup is None


def test_stats_predicted_speedup_uses_measured_costs():
    s = RequestStats()
    s.record_step(drafted=2, accepted=1, emitted=2)
    s.record_step(drafted=2, accepted=1, emitted=2)
    assert s.predicted_speedup is None  # no step time measured yet
    s.decode_step_s = 0.01
    s.draft_s = 0.004  # 0.001 s per drafted token: c = 0.1
    s.verify_s = 0.024  # 0.012 s per verify: v = 1.2
    assert s.predicted_speedup == pytest.approx(predicted_speedup(0.5, 2, 0.1, 1.2))
    plain = RequestStats(target_forwards=3, tokens_generated=3, decode_step_s=0.01)
    assert plain.predicted_speedup == 1.0


def test_tokens_per_s():
    s = RequestStats(tokens_generated=30, wall_s=1.5)
    assert s.tokens_per_s == pytest.approx(20.0)


def test_to_dict_has_raw_and_derived_keys_and_is_json():
    s = RequestStats(prompt_tokens=3)
    s.record_step(drafted=2, accepted=1, emitted=2)
    d = s.to_dict()
    raw = {"prompt_tokens", "tokens_generated", "target_forwards", "drafted_tokens", "accepted_tokens",
           "rejections", "drafted_by_position", "accepted_by_position", "prefill_s", "draft_s", "verify_s",
           "control_s", "wall_s", "decode_step_s", "kv_bytes", "kv_bytes_per_token", "draft_kv_bytes",
           "draft_kv_bytes_per_token", "prefix_hit_tokens", "tree_steps", "steps_by_budget", "accepted_by_budget",
           "prediction_tokens", "prediction_drafted", "prediction_accepted", "forced_drafted", "forced_accepted",
           "grammar_s"}
    derived = {"acceptance_rate", "token_acceptance", "mean_accepted_length", "mean_gamma", "acceptance_by_position",
               "accepted_length_by_budget", "tokens_per_s", "predicted_speedup"}
    assert set(d) == raw | derived
    assert d["accepted_by_position"] == [1, 0] and d["acceptance_rate"] == 0.5
    assert d["steps_by_budget"] == [0, 0, 1] and d["accepted_length_by_budget"] == [None, None, 2.0]
    assert d["rejections"] == 1 and d["token_acceptance"] == 0.5
    assert d["kv_bytes"] == 0 and d["kv_bytes_per_token"] == 0.0 and d["prefix_hit_tokens"] == 0  # set by the engine
    assert json.loads(json.dumps(d)) == d


def test_a_tree_step_counts_its_levels_by_position_and_its_nodes_by_budget():
    s = RequestStats()
    s.record_step(drafted=5, accepted=2, emitted=3, depth=3)  # 5 nodes over 3 levels, 2 kept
    s.record_step(drafted=2, accepted=2, emitted=3)  # a chain, all kept
    assert s.tree_steps == 1 and s.drafted_tokens == 7 and s.accepted_tokens == 4
    assert s.drafted_by_position == [2, 2, 1] and s.accepted_by_position == [2, 2, 0]
    assert s.rejections == 1  # the tree stopped above its deepest level; the chain was all kept
    assert s.accepted_length_by_budget == [None, None, 3.0, None, None, 3.0]


def test_token_acceptance_recovers_a_geometric_acceptance_rate():
    """Steps that stop at the first rejection: accepted/drafted is biased low, the estimate is not."""
    import random

    rng = random.Random(0)
    a, k = 0.8, 4
    s = RequestStats()
    for _ in range(20000):
        accepted = 0
        while accepted < k and rng.random() < a:
            accepted += 1
        s.record_step(drafted=k, accepted=accepted, emitted=accepted + 1)
    assert s.token_acceptance == pytest.approx(a, abs=0.01)
    assert s.acceptance_rate < a - 0.1
    assert s.mean_accepted_length == pytest.approx(expected_tokens_per_step(a, k), rel=0.02)
