"""Acceptance rules for drafted tokens: pure functions on tensors (no model, no cache).

The lossless rule (Leviathan et al. 2023; Chen et al. 2023): accept draft token d_i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a token from normalize(max(0, p_i - q_i)); if
all k are accepted emit a bonus token from p_{k+1}. The output distribution then equals the target's.
A deterministic drafter has q = one-hot(d_i). Greedy (temperature 0) accepts while d_i == argmax p_i.

Token trees (``tree.py``) generalize the chain, which stays the special case. From the root down, at each
node: greedy follows the child equal to the target's argmax; a deterministic tree (n-gram) draws the
target's own token at that position and follows the child equal to it; a stochastic tree uses recursive
rejection sampling over the node's children, which the drafter drew without replacement from q (Jeon et
al. 2024, "Recursive Speculative Decoding"; SpecTr, Sun et al. 2023, for the idea): child c_i is accepted
with probability min(1, p_i(c_i) / q_i(c_i)); after a rejection p_{i+1} = normalize(max(0, p_i - q_i)) and
q_{i+1} = q_i without c_i, renormalized; when every child is rejected the token is drawn from the last
p_i. Each emitted token is then distributed as the target's p, whatever the tree.

This module does not offer the lossy "accept if p >= q, sample p / (1 - q)" rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdecode import tree
from specdecode.sampling import SamplingParams, argmax_ids, position_generator, probs_from_logits, sample


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft.

    Args:
        accepted: how many draft tokens were kept (0..k).
        tokens: the kept draft tokens followed by one token from the target (correction or bonus).
        path: for a tree, the kept nodes root-down (their rows are ``1 + node``); None for a chain, whose
            first ``accepted`` tokens are kept.
    """

    accepted: int
    tokens: list[int]
    path: list[int] | None = None


def verify_greedy(target_logits: torch.Tensor, draft: list[int]) -> Verdict:
    """Greedy verification.

    Args:
        target_logits: ``[k + 1, V]`` target logits at the positions of [last token, d_1..d_k].
        draft: the k drafted tokens.
    """
    return _accept_greedy(argmax_ids(target_logits).tolist(), draft)  # one host sync for the whole draft


def _accept_greedy(best: Sequence[int], draft: list[int]) -> Verdict:
    """Keeps drafted tokens while they equal the target's argmax ``best`` at their position."""
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return Verdict(n, draft[:n] + [best[n]])


def verify_stochastic(p: torch.Tensor, q: torch.Tensor | None, draft: list[int],
                      generator: torch.Generator) -> Verdict:
    """Lossless speculative sampling.

    Args:
        p: ``[k + 1, V]`` target probabilities (after temperature/top-k/top-p).
        q: ``[k, V]`` draft probabilities after the same processing, or None for a deterministic
            drafter (q = one-hot on each drafted token).
        draft: the k drafted tokens.
        generator: the request's random generator, on the device of ``p`` and ``q``.
    """
    k = len(draft)
    if k:
        d = torch.tensor(draft, device=p.device)
        rows = torch.arange(k, device=p.device)
        p_d = p[rows, d]  # [k]
        q_d = q[rows, d] if q is not None else torch.ones(k, device=p.device)
        u = torch.rand(k, generator=generator, device=p.device)  # the generator must live on p's device
        # u < p/q written as u*q < p: no division, and q_d > 0 for any token the draft could emit.
        rejected = (u * q_d >= p_d).tolist()
        n = rejected.index(True) if True in rejected else k
    else:
        n = 0
    if n == k:
        return Verdict(k, draft + [int(sample(p[k:k + 1], generator))])
    if q is not None:
        residual = (p[n] - q[n]).clamp_(min=0.0)
    else:
        residual = p[n].clone()
        residual[draft[n]] = 0.0  # max(0, p - onehot(d)) is p with d removed
    total = residual.sum()
    # A zero residual means p == q on this row, where rejection has probability 0: only rounding gets here.
    dist = residual / total if total > 0 else p[n]
    return Verdict(n, draft[:n] + [int(sample(dist[None], generator))])


def verify_coupled(p: torch.Tensor, draft: list[int], seed: int, position: int) -> Verdict:
    """Sampling verification of a deterministic draft (q = one-hot: n-gram lookup, or no draft at all).

    At each position the target's own token is drawn from ``p`` with a generator keyed by (seed,
    position), and drafted tokens are kept while they equal it. Each emitted token is a draw from p, and
    d_i is kept with probability p_i(d_i), as under the rejection rule for a one-hot q; moreover the
    tokens are exactly those plain sampling with the same seed draws, whatever the draft lengths or the
    batch.

    Args:
        p: ``[k + 1, V]`` target probabilities at [last token, d_1..d_k].
        draft: the k drafted tokens.
        seed: the request's seed.
        position: index in the sequence (prompt included) of the first token this step emits.
    """
    tokens = []
    for i in range(len(draft) + 1):
        tokens.append(int(sample(p[i:i + 1], position_generator(seed, position + i, p.device))))
        if i == len(draft) or tokens[i] != draft[i]:
            return Verdict(i, tokens)
    raise AssertionError("unreachable")


def verify_tree_greedy(best: Sequence[int], draft: list[int], parents: list[int]) -> Verdict:
    """Greedy verification of a tree: from the root, follow the child equal to the target's argmax.

    Args:
        best: the target's argmax at rows [root, node 0, ..., node n-1].
        draft: the nodes' tokens; ``parents`` their parents (-1 = the root).
    """
    return _walk(draft, parents, lambda row, depth: best[row])


def verify_tree_coupled(p: torch.Tensor, draft: list[int], parents: list[int], seed: int, position: int) -> Verdict:
    """Sampling verification of a deterministic tree: at each node on the way down, the target's own token
    is drawn from ``p`` by (seed, position), as :func:`verify_coupled` does for a chain, and the walk goes on
    while a child holds it. The tokens are those plain sampling with the same seed draws.

    Args:
        p: ``[n + 1, V]`` target probabilities at rows [root, node 0, ..., node n-1].
        draft: the nodes' tokens; ``parents`` their parents.
        seed: the request's seed.
        position: index of the first token this step emits.
    """
    return _walk(draft, parents, lambda row, depth: int(sample(p[row:row + 1],
                                                               position_generator(seed, position + depth, p.device))))


def _walk(draft: list[int], parents: list[int], pick) -> Verdict:
    """Goes down the tree while a child of the current node holds ``pick(row, depth)``, the target's token there."""
    kids = tree.children(parents)
    path, node = [], -1
    while True:
        token = pick(node + 1, len(path))
        child = next((c for c in kids.get(node, ()) if draft[c] == token), None)
        if child is None:
            return Verdict(len(path), [draft[c] for c in path] + [token], path)
        path.append(child)
        node = child


def verify_tree_stochastic(p: torch.Tensor, q: torch.Tensor, draft: list[int], parents: list[int],
                           generator: torch.Generator) -> Verdict:
    """Recursive rejection sampling down a tree whose siblings were drawn without replacement (module docstring).

    Args:
        p: ``[n + 1, V]`` target probabilities at rows [root, node 0, ..., node n-1].
        q: ``[n, V]``: ``q[i]`` is the distribution node i and its siblings were drawn from (without
            replacement, in node order), after the target's processing.
        draft: the nodes' tokens; ``parents`` their parents.
        generator: the request's generator.
    """
    kids = tree.children(parents)
    path, node = [], -1
    while True:
        residual, left = p[node + 1].clone(), None
        child = None
        for c in kids.get(node, ()):
            if left is None:
                left = q[c].clone()
            u = float(torch.rand((), generator=generator, device=p.device))
            if u * float(left[draft[c]]) < float(residual[draft[c]]):
                child = c
                break
            residual = (residual - left).clamp_(min=0.0)
            total = residual.sum()
            # Zero only when p == q here, where rejection has probability 0: rounding alone gets here.
            residual = residual / total if total > 0 else p[node + 1].clone()
            left[draft[c]] = 0.0
            mass = left.sum()
            if mass <= 0:
                break
            left = left / mass
        if child is None:
            token = int(sample(residual[None], generator))
            return Verdict(len(path), [draft[c] for c in path] + [token], path)
        path.append(child)
        node = child


@dataclass(frozen=True, kw_only=True)
class Pending:
    """One sequence's draft waiting for :func:`verify_batch`.

    Args:
        tokens: the drafted tokens (possibly none).
        q: ``[k, V]`` draft probabilities, None for a deterministic drafter.
        sampling: the request's sampling parameters (temperature 0 = greedy).
        seed: the request's seed (deterministic drafts and plain steps draw by position).
        position: index of the first token this step emits.
        generator: the request's generator (stochastic drafts only).
        parents: the draft's tree (``tree.py``), None for a chain.
    """

    tokens: list[int]
    q: torch.Tensor | None
    sampling: SamplingParams
    seed: int
    position: int
    generator: torch.Generator | None = None
    parents: list[int] | None = None


def verify_batch(logits: torch.Tensor, counts: Sequence[int], pending: Sequence[Pending]) -> list[Verdict]:
    """Verifies the drafts of several sequences scored by one forward (rows flattened, as ``forward_rows`` gives them).

    Greedy rows share one argmax over the whole batch. A sampled sequence draws with its own seed: by
    position for deterministic drafts (:func:`verify_coupled`, so its tokens do not depend on the batch),
    from its own generator for stochastic ones (:func:`verify_stochastic`). Trees (``Pending.parents``) take
    the tree forms of the same rules.

    Args:
        logits: ``[N, V]`` target logits; sequence i owns ``counts[i]`` consecutive rows, the first
            ``len(tokens_i) + 1`` of them at [last token, d_1..d_k] (any further rows are padding).
        counts: rows per sequence.
        pending: per sequence, its draft and how to sample.
    """
    if len(counts) != len(pending):
        raise ValueError(f"verify_batch needs one row count per sequence: {len(counts)} counts, {len(pending)} drafts")
    best = argmax_ids(logits).tolist() if any(x.sampling.greedy for x in pending) else []  # one host sync
    verdicts, start = [], 0
    for n, x in zip(counts, pending):
        end = start + len(x.tokens) + 1
        rows = logits[start:end]
        if x.parents is not None and not tree.is_chain(x.parents):
            verdicts.append(_verify_tree(best[start:end], rows, x))
        elif x.sampling.greedy:
            verdicts.append(_accept_greedy(best[start:end], x.tokens))
        elif x.q is None:
            verdicts.append(verify_coupled(probs_from_logits(rows, x.sampling), x.tokens, x.seed, x.position))
        else:
            verdicts.append(verify_stochastic(probs_from_logits(rows, x.sampling), x.q, x.tokens, x.generator))
        start += n
    return verdicts


def _verify_tree(best: Sequence[int], logits: torch.Tensor, x: Pending) -> Verdict:
    if x.sampling.greedy:
        return verify_tree_greedy(best, x.tokens, x.parents)
    p = probs_from_logits(logits, x.sampling)
    if x.q is None:
        return verify_tree_coupled(p, x.tokens, x.parents, x.seed, x.position)
    return verify_tree_stochastic(p, x.q, x.tokens, x.parents, x.generator)
