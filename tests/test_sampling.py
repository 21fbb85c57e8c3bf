"""probs_from_logits (temperature, top-k, top-p) and SamplingParams."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.sampling import Penalties, SamplingParams, argmax_ids, penalize, probs_from_logits, sample


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def _random_logits(shape=(5, 50), seed=0) -> torch.Tensor:
    return 3 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_one_hot_on_argmax():
    logits = _random_logits((3, 4, 50))
    probs = probs_from_logits(logits, SamplingParams(temperature=0.0))
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(3, 4))
    assert torch.equal((probs == 1).sum(-1), torch.ones(3, 4, dtype=torch.long))
    assert SamplingParams().greedy and not SamplingParams(temperature=0.1).greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_ids_pick_what_argmax_picks_among_ties_infinities_and_nan(dtype):
    # greedy decoding's pick: the first of tied maxima, NaN counting as the largest, in every row and layout
    g = torch.Generator().manual_seed(0)
    for vocab in (1, 7, 49152, 151937):
        logits = torch.randint(-2, 2, (9, vocab), generator=g).to(dtype)  # few values: ties everywhere
        logits[1] = float("-inf")
        logits[2, vocab // 2] = float("nan")
        logits[3, :] = 1.0
        for x in (logits, logits[:, : (vocab + 1) // 2], logits.T.contiguous().T, logits[4]):
            assert torch.equal(argmax_ids(x), x.argmax(-1))



@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_is_softmax_of_scaled_logits(temperature):
    logits = _random_logits()
    probs = probs_from_logits(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, (logits / temperature).softmax(-1))


def test_bfloat16_logits_give_float32_probs():
    logits = _random_logits().bfloat16()
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, logits.float().softmax(-1))


@pytest.mark.parametrize("k", [1, 3, 49])
def test_top_k_keeps_exactly_k_most_likely(k):
    logits = _random_logits()
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=k))
    assert torch.equal((probs > 0).sum(-1), torch.full((5,), k))
    top = logits.topk(k, dim=-1).indices
    assert (probs.gather(-1, top) > 0).all()
    # Renormalised softmax over the kept tokens.
    want = torch.zeros_like(logits).scatter(-1, top, logits.gather(-1, top).softmax(-1))
    torch.testing.assert_close(probs, want)


@pytest.mark.parametrize("k", [0, 50, 1000])
def test_top_k_zero_or_at_least_vocab_keeps_all(k):
    logits = _random_logits()
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=k))
    torch.testing.assert_close(probs, logits.softmax(-1))


@pytest.mark.parametrize("top_p, kept", [(0.3, 1), (0.49, 1), (0.51, 2), (0.79, 2), (0.81, 3), (0.94, 3),
                                         (0.96, 4), (1.0, 4)])
def test_top_p_keeps_the_minimal_set(top_p, kept):
    dist = [0.05, 0.5, 0.15, 0.3]  # sorted: 0.5, 0.3, 0.15, 0.05 (ids 1, 3, 2, 0)
    probs = probs_from_logits(_logits(dist), SamplingParams(temperature=1.0, top_p=top_p))
    order = [1, 3, 2, 0]
    assert (probs[order[:kept]] > 0).all()
    assert (probs[order[kept:]] == 0).all()
    mass = sum(dist[i] for i in order[:kept])
    want = torch.zeros(4)
    want[order[:kept]] = torch.tensor([dist[i] / mass for i in order[:kept]])
    torch.testing.assert_close(probs, want)


def test_top_p_always_keeps_the_top_token():
    probs = probs_from_logits(_logits([0.97, 0.01, 0.01, 0.01]), SamplingParams(temperature=1.0, top_p=0.01))
    assert torch.equal(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_top_p_applies_after_temperature():
    # At T=1 the top token holds 0.5, so top_p 0.6 needs two tokens; at T=0.5 it holds 0.25/0.365 > 0.6.
    logits = _logits([0.5, 0.3, 0.15, 0.05])
    assert (probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.6)) > 0).sum() == 2
    sharp = (logits / 0.5).softmax(-1)
    assert sharp[0] > 0.6
    assert (probs_from_logits(logits, SamplingParams(temperature=0.5, top_p=0.6)) > 0).sum() == 1


def test_top_k_and_top_p_together():
    # top_k=3 renormalises 0.4/0.3/0.2/0.1 to 4/9, 3/9, 2/9. top_p=0.75 alone keeps 3 tokens
    # (0.4 + 0.3 < 0.75), but applied after top_k it keeps 2 (4/9 + 3/9 >= 0.75).
    logits = _logits([0.4, 0.3, 0.2, 0.1])
    alone = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.75))
    both = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.75))
    assert (alone > 0).sum() == 3
    assert (both > 0).sum() == 2
    torch.testing.assert_close(both, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
    SamplingParams(),
])
def test_rows_sum_to_one(params):
    probs = probs_from_logits(_random_logits((2, 6, 50)), params)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 6))
    assert (probs >= 0).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), r"SamplingParams\.temperature must be >= 0, got -0\.5"),
    (dict(temperature=float("nan")), r"SamplingParams\.temperature must be >= 0, got nan"),
    (dict(top_k=-1), r"SamplingParams\.top_k must be >= 0 \(0 = off\), got -1"),
    (dict(top_p=0.0), r"SamplingParams\.top_p must be in \(0, 1\], got 0\.0"),
    (dict(top_p=1.5), r"SamplingParams\.top_p must be in \(0, 1\], got 1\.5"),
    (dict(top_p=-0.1), r"SamplingParams\.top_p must be in \(0, 1\], got -0\.1"),
])
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_same_seed_same_draws_different_seed_different_draws():
    a = torch.rand(8, generator=SamplingParams(seed=123).generator())
    b = torch.rand(8, generator=SamplingParams(seed=123).generator())
    c = torch.rand(8, generator=SamplingParams(seed=124).generator())
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_unseeded_generators_differ():
    draws = {tuple(torch.rand(4, generator=SamplingParams().generator()).tolist()) for _ in range(3)}
    assert len(draws) == 3


def test_sample_draws_only_from_the_support():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(probs, g) for _ in range(50)])
    assert draws.shape == (50, 2)
    assert set(draws[:, 0].tolist()) == {1, 3}
    assert set(draws[:, 1].tolist()) == {2}


def test_extreme_but_valid_parameters_give_a_distribution():
    """top_p below float32's least value keeps the top token (not nothing: NaN), and a temperature too small to
    divide by is greedy (logits / 1e-300 overflow), as the server's fuzzer found."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=5e-324))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    tiny = SamplingParams(temperature=1e-300)
    assert tiny.greedy and torch.equal(probs_from_logits(logits, tiny), probs)
    assert not SamplingParams(temperature=1e-4).greedy


def test_penalties_by_hand():
    """Row 0 follows the request's tokens, row 1 also drafted token 1, row 2 tokens 1 and 3: presence and frequency
    count generated tokens (the drafted ones on the row's path too), repetition also the prompt's, bias adds."""
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]] * 3)
    penalize(logits, Penalties(presence=0.5, frequency=0.25, repetition=2.0, bias=((3, 1.0),)), prompt=[2],
             generated=[0, 0], paths=[[], [1], [1, 3]])
    assert logits.tolist() == [[0.0, 1.0, -2.0, 1.5], [0.0, -0.25, -2.0, 1.5], [0.0, -0.25, -2.0, 0.5]]


def test_penalties_leave_masked_tokens_masked_and_refuse_a_repetition_that_would_overflow():
    logits = torch.tensor([[float("-inf"), 1.0, 0.0]])
    penalize(logits, Penalties(presence=-2.0, repetition=0.5, bias=((0, 100.0),)), [0], [0], [[]])
    assert logits[0, 0] == float("-inf")
    for bad in (0.0, 5e-324, 1e6):
        with pytest.raises(ValueError, match="repetition"):
            Penalties(repetition=bad)


def test_min_p_drops_tokens_under_its_share_of_the_top_one_and_keeps_the_top():
    probs = probs_from_logits(torch.tensor([3.0, 1.0, 0.0, 2.9]), SamplingParams(temperature=1.0, min_p=0.2))
    kept = probs > 0
    assert kept.tolist() == [True, False, False, True] and abs(float(probs.sum()) - 1.0) < 1e-6
    assert probs_from_logits(torch.tensor([1.0, 1.0]), SamplingParams(temperature=1.0, min_p=1.0)).tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
