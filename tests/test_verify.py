"""Acceptance rules: greedy and lossless stochastic verification."""

from __future__ import annotations

import pytest
import torch

from specdecode.verify import Verdict, verify_greedy, verify_stochastic

V = 12


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_probs(rows: int, seed: int, vocab: int = V) -> torch.Tensor:
    return (2 * torch.randn(rows, vocab, generator=_gen(seed))).softmax(-1)


# --------------------------------------------------------------------------- greedy


def _greedy_logits(best: list[int]) -> torch.Tensor:
    logits = torch.randn(len(best), V, generator=_gen(0))
    logits[torch.arange(len(best)), torch.tensor(best)] = 10.0
    return logits


def test_greedy_all_accepted_emits_bonus_argmax_of_last_row():
    logits = _greedy_logits([4, 7, 1, 9])
    assert verify_greedy(logits, [4, 7, 1]) == Verdict(3, [4, 7, 1, 9])


@pytest.mark.parametrize("draft, accepted, tokens", [
    ([5, 7, 1], 0, [4]),
    ([4, 5, 1], 1, [4, 7]),
    ([4, 7, 5], 2, [4, 7, 1]),
    ([4, 5, 5], 1, [4, 7]),  # a later match does not count after a rejection
])
def test_greedy_stops_at_first_rejection_with_target_argmax(draft, accepted, tokens):
    assert verify_greedy(_greedy_logits([4, 7, 1, 9]), draft) == Verdict(accepted, tokens)


def test_greedy_empty_draft_emits_argmax():
    assert verify_greedy(_greedy_logits([6]), []) == Verdict(0, [6])


# --------------------------------------------------------------------------- stochastic


def test_p_equal_q_accepts_everything():
    k = 5
    for seed in range(40):
        p = _random_probs(k + 1, seed)
        q = p[:k].clone()
        g = _gen(1000 + seed)
        draft = torch.multinomial(q, 1, generator=g).squeeze(-1).tolist()
        verdict = verify_stochastic(p, q, draft, g)
        assert verdict.accepted == k
        assert verdict.tokens[:k] == draft and len(verdict.tokens) == k + 1


def test_all_accepted_bonus_comes_from_last_row_of_p():
    k = 3
    p = _random_probs(k + 1, 0)
    p[k] = 0.0
    p[k, 8] = 1.0
    verdict = verify_stochastic(p, p[:k].clone(), [0, 1, 2], _gen(0))
    assert verdict == Verdict(3, [0, 1, 2, 8])


def test_draft_token_with_zero_target_probability_is_always_rejected():
    k = 3
    for seed in range(60):
        p = _random_probs(k + 1, seed)
        q = _random_probs(k, seed + 500)
        draft = [3, 5, 7]
        p[0, 3] = 0.0
        p[0] /= p[0].sum()
        verdict = verify_stochastic(p, q, draft, _gen(seed))
        assert verdict.accepted == 0
        assert len(verdict.tokens) == 1 and verdict.tokens[0] != 3
        # The replacement comes from max(0, p - q): only tokens where p exceeds q.
        assert p[0, verdict.tokens[0]] > q[0, verdict.tokens[0]]


def test_rejection_resamples_from_the_residual_support():
    # p and q overlap on tokens 0..3; the residual max(0, p - q) lives on tokens 4 and 5 only.
    p = torch.tensor([[0.1, 0.1, 0.1, 0.1, 0.3, 0.3, 0.0, 0.0]])
    p = torch.cat([p, torch.full((1, 8), 1 / 8)])
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25, 0.0, 0.0, 0.0, 0.0]])
    seen = set()
    rejections = 0
    for seed in range(300):
        verdict = verify_stochastic(p, q, [2], _gen(seed))
        if verdict.accepted == 0:
            rejections += 1
            seen.add(verdict.tokens[0])
    assert seen == {4, 5}
    # P(accept) = p/q = 0.4; 300 trials put the rejection count within 180 +- 45 with overwhelming odds.
    assert 135 < rejections < 225


def test_one_hot_q_residual_excludes_the_drafted_token():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    accepted = 0
    replacements = set()
    trials = 2000
    for seed in range(trials):
        verdict = verify_stochastic(p, None, [0], _gen(seed))
        if verdict.accepted:
            accepted += 1
            assert verdict.tokens[0] == 0 and len(verdict.tokens) == 2
        else:
            assert len(verdict.tokens) == 1
            replacements.add(verdict.tokens[0])
    assert replacements == {1, 2}  # never the drafted 0, never the impossible 3
    # With q one-hot, acceptance probability is p(d) = 0.5: 2000 trials, 5 sigma = +-112.
    assert abs(accepted - trials * 0.5) < 112


def test_one_hot_q_rejects_a_token_the_target_cannot_emit():
    p = torch.tensor([[0.0, 1.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    for seed in range(30):
        assert verify_stochastic(p, None, [0], _gen(seed)) == Verdict(0, [1])


def test_empty_draft_samples_from_first_row():
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert verify_stochastic(p, None, [], _gen(0)) == Verdict(0, [2])
    assert verify_stochastic(p, torch.zeros(0, 4), [], _gen(0)) == Verdict(0, [2])


@pytest.mark.parametrize("one_hot", [False, True])
def test_token_counts_between_one_and_k_plus_one(one_hot):
    k = 4
    counts = set()
    for seed in range(200):
        p = _random_probs(k + 1, seed, vocab=4)
        q = _random_probs(k, seed + 10_000, vocab=4)
        g = _gen(seed)
        draft = torch.multinomial(q, 1, generator=g).squeeze(-1).tolist()
        verdict = verify_stochastic(p, None if one_hot else q, draft, g)
        assert 0 <= verdict.accepted <= k
        assert len(verdict.tokens) == verdict.accepted + 1
        assert verdict.tokens[:verdict.accepted] == draft[:verdict.accepted]
        counts.add(len(verdict.tokens))
    assert counts == set(range(1, k + 2))  # every outcome from "reject first" to "accept all" occurs


def test_first_token_follows_the_target_distribution():
    """Losslessness at one position: whatever q is, the first emitted token is distributed as p[0].

    10000 draws over 5 tokens; chi-square with 4 degrees of freedom, threshold 23.5 (false-failure
    probability 1e-4; fixed seeds, so a run is reproducible).
    """
    p = torch.tensor([[0.4, 0.25, 0.2, 0.1, 0.05], [0.2] * 5])
    q = torch.tensor([[0.1, 0.1, 0.5, 0.2, 0.1]])
    g = _gen(7)
    n = 10_000
    drafts = torch.multinomial(q[0], n, replacement=True, generator=g).tolist()
    counts = torch.zeros(5)
    for d in drafts:
        counts[verify_stochastic(p, q, [d], g).tokens[0]] += 1
    expected = n * p[0]
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 23.5, (counts.tolist(), expected.tolist())
