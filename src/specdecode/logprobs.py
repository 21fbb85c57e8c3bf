"""Log-probabilities of emitted tokens, as OpenAI's ``logprobs`` report them.

Each emitted token's log-probability, and the ``top`` most likely tokens at its position, come from the
target's own distribution there: the log-softmax of its logits at the row that predicted the token, before
temperature, top-k or top-p (vLLM's default too); under a grammar, of the logits it masked, so tokens it refuses
are never listed as alternatives. A draft only decides which rows a forward computes, and our
forwards give every row the bits it has alone, so a request's log-probabilities are the same with and without
speculation, batched or not.

It does not choose tokens (``verify.py``) or format answers (``serve/replies.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability.

    Args:
        token: the token id.
        logprob: its log-probability under the target's distribution at its position.
        top: the ``top`` most likely (token id, log-probability) pairs there, most likely first (fewer where fewer
            tokens are possible: a grammar's masked row).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The log-probabilities of ``tokens``, token i under the target's logits ``rows[i]``.

    Args:
        rows: ``[len(tokens), V]`` logits, row i the one that predicted token i.
        tokens: the emitted tokens.
        top: alternatives to list per token (0: none).
    """
    out = []
    for row, token in zip(rows, tokens):  # a row at a time: each row's numbers whatever else was computed
        logp = torch.log_softmax(row.float(), -1)  # [V]
        best = logp.topk(top) if top else None
        alternatives = tuple((t, v) for t, v in zip(best.indices.tolist(), best.values.tolist())
                             if v != float("-inf")) if best is not None else ()
        out.append(TokenLogprob(token, float(logp[token]), alternatives))
    return out


def verdict_rows(accepted: int, path: list[int] | None) -> list[int]:
    """The rows (of a sequence's [fed token, drafts] rows) that predicted a step's emitted tokens: the fed
    token's row, then those of the kept drafts (a chain's first ``accepted``, or a tree's ``path`` nodes)."""
    return [0, *(1 + node for node in path)] if path is not None else list(range(accepted + 1))
