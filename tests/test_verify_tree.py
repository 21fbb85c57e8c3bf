"""Tree verification: greedy and coupled walks, and recursive rejection sampling kept lossless."""

from __future__ import annotations

import pytest
import torch

from specdecode.sampling import SamplingParams, position_generator, sample
from specdecode.verify import (Pending, verify_batch, verify_greedy, verify_tree_coupled, verify_tree_greedy,
                               verify_tree_stochastic)
from distribution_check import chi_square_p_value

V = 6
# Root children 2, 4, 5 (nodes 0, 1, 2); node 0's children 1, 3 (nodes 3, 4); node 4's child 0 (node 5).
TOKENS = [2, 4, 5, 1, 3, 0]
PARENTS = [-1, -1, -1, 0, 0, 4]


@pytest.mark.parametrize("best, accepted, tokens, path", [
    ([4, 0, 0, 0, 0, 0, 0], 1, [4, 0], [1]),  # second root child, then no child of node 1
    ([2, 3, 0, 0, 0, 0, 5], 3, [2, 3, 0, 5], [0, 4, 5]),  # down the deepest branch, bonus from node 5's row
    ([1, 0, 0, 0, 0, 0, 0], 0, [1], []),  # no root child holds the target's token
])
def test_greedy_follows_the_argmax_down_the_tree(best, accepted, tokens, path):
    verdict = verify_tree_greedy(best, TOKENS, PARENTS)
    assert (verdict.accepted, verdict.tokens, verdict.path) == (accepted, tokens, path)


def test_a_chain_tree_verifies_as_the_chain():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(1))
    best = logits.argmax(-1).tolist()
    draft = [best[0], best[1], (best[2] + 1) % V, 3]
    chain = verify_greedy(logits, draft)
    walked = verify_tree_greedy(best, draft, [-1, 0, 1, 2])
    assert (walked.accepted, walked.tokens, walked.path) == (chain.accepted, chain.tokens, [0, 1])


def test_the_coupled_walk_emits_the_tokens_plain_sampling_draws():
    """Whatever the tree, each emitted token is the target's own draw for (seed, position)."""
    p = (0.3 * torch.randn(len(TOKENS) + 1, V, generator=torch.Generator().manual_seed(2))).softmax(-1)
    seen_accepting = False
    for seed in range(200):
        verdict = verify_tree_coupled(p, TOKENS, PARENTS, seed, position=10)
        rows = [0] + [1 + n for n in verdict.path]
        draws = [int(sample(p[r:r + 1], position_generator(seed, 10 + i, p.device))) for i, r in enumerate(rows)]
        assert verdict.tokens == draws
        assert [TOKENS[n] for n in verdict.path] == verdict.tokens[:-1]
        seen_accepting |= verdict.accepted >= 2
    assert seen_accepting  # the test reached the second level


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target p after the prompt ``[V]`` and after each first token ``[V, V]``; draft q likewise: half the
    target's, half noise (so p exceeds q on several tokens: later siblings get accepted), with zeros."""
    g = torch.Generator().manual_seed(seed)
    p0, p1 = (0.8 * torch.randn(V, generator=g)).softmax(-1), (0.8 * torch.randn(V, V, generator=g)).softmax(-1)
    q0 = (p0 + (0.8 * torch.randn(V, generator=g)).softmax(-1)) / 2
    q1 = (p1 + (0.8 * torch.randn(V, V, generator=g)).softmax(-1)) / 2
    q0[p0.argmin()] = 0.0  # a token the target may emit but the draft never proposes
    q1[torch.arange(V), p1.argmin(-1)] = 0.0
    return p0, p1, q0 / q0.sum(), q1 / q1.sum(-1, keepdim=True)


def _draw_tree(p0, p1, q0, q1, g) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """Three root children drawn without replacement from q0, two children of the first from its q1 row."""
    first = torch.multinomial(q0, 3, replacement=False, generator=g).tolist()
    second = torch.multinomial(q1[first[0]], 2, replacement=False, generator=g).tolist()
    tokens, parents = first + second, [-1, -1, -1, 0, 0]
    q = torch.stack([q0, q0, q0, q1[first[0]], q1[first[0]]])
    # Rows [root, nodes]: p after the prompt, after each first token, and (unused here) after two tokens.
    p = torch.stack([p0, *(p1[t] for t in first), p1[0], p1[0]])
    return tokens, parents, p, q


@pytest.mark.parametrize("seed", [0, 1])
def test_recursive_rejection_over_siblings_is_lossless(seed):
    """The first two emitted tokens follow the target's joint p0(x) p1[x](y), with three siblings drawn
    without replacement at the first position and two under the first of them (chi-square, alpha 1e-3;
    a second token not emitted by the step is drawn from p1 as the next step would)."""
    p0, p1, q0, q1 = _tables(seed)
    g = torch.Generator().manual_seed(100 + seed)
    counts = torch.zeros(V, V)
    siblings_seen = 0
    for _ in range(12_000):
        tokens, parents, p, q = _draw_tree(p0, p1, q0, q1, g)
        verdict = verify_tree_stochastic(p, q, tokens, parents, g)
        out = verdict.tokens
        if verdict.path and verdict.path[0] != 0:
            siblings_seen += 1
        if len(out) == 1:
            out = out + [int(torch.multinomial(p1[out[0]], 1, generator=g))]
        counts[out[0], out[1]] += 1
    assert siblings_seen > 500  # later siblings were accepted, not only the first
    p_value = chi_square_p_value(counts, p0[:, None] * p1)
    assert p_value > 1e-3, p_value


def test_the_lossy_rule_fails_the_same_test():
    """Negative control: accepting siblings by p(c) >= q(c) (the seed's rule) misses the joint."""
    p0, p1, q0, q1 = _tables(0)
    g = torch.Generator().manual_seed(100)
    counts = torch.zeros(V, V)
    for _ in range(12_000):
        tokens, parents, p, q = _draw_tree(p0, p1, q0, q1, g)
        first = next((t for t in tokens[:3] if p0[t] >= q0[t]), None)
        if first is None:
            first = int(torch.multinomial(p0, 1, generator=g))
        counts[first, int(torch.multinomial(p1[first], 1, generator=g))] += 1
    assert chi_square_p_value(counts, p0[:, None] * p1) < 1e-3


def test_verify_batch_takes_trees_and_chains_together():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(TOKENS) + 1 + 3, V, generator=g)
    greedy = SamplingParams()
    best = logits.argmax(-1).tolist()
    chain = [best[7], 0]
    verdicts = verify_batch(logits, [len(TOKENS) + 1, 3], [
        Pending(tokens=TOKENS, q=None, sampling=greedy, seed=0, position=5, parents=PARENTS),
        Pending(tokens=chain, q=None, sampling=greedy, seed=0, position=9)])
    assert verdicts[0] == verify_tree_greedy(best[:7], TOKENS, PARENTS)
    assert verdicts[1].tokens[0] == best[7] and verdicts[1].path is None
