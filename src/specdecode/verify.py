"""Acceptance rules for drafted tokens: pure functions on tensors (no model, no cache).

The lossless rule (Leviathan et al. 2023; Chen et al. 2023): accept draft token d_i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a token from normalize(max(0, p_i - q_i)); if
all k are accepted emit a bonus token from p_{k+1}. The output distribution then equals the target's.
A deterministic drafter has q = one-hot(d_i). Greedy (temperature 0) accepts while d_i == argmax p_i.
This module does not offer the lossy "accept if p >= q, sample p / (1 - q)" rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.sampling import sample


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft.

    Args:
        accepted: how many draft tokens were kept (0..k).
        tokens: the kept draft tokens followed by one token from the target (correction or bonus).
    """

    accepted: int
    tokens: list[int]


def verify_greedy(target_logits: torch.Tensor, draft: list[int]) -> Verdict:
    """Greedy verification.

    Args:
        target_logits: ``[k + 1, V]`` target logits at the positions of [last token, d_1..d_k].
        draft: the k drafted tokens.
    """
    best = target_logits.argmax(-1).tolist()  # one host sync for the whole draft
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
