"""Acceptance: a step's verdicts, each slot rolled back to what was kept, the emitted tokens' log-probabilities,
and the verified tokens committed to their sequences.

Verification is ``verify.verify_batch`` over the masked logits. Rollback keeps each decoding sequence's fed token
and accepted drafts (a tree's path moved into place) and only lowers a length; the token the target emits is not
cached yet (the next step feeds it). A drafter that reads the target's features gets the kept rows'. Committing
cuts the tokens where plain decoding stops (end-of-sequence, stop string, budget, a complete grammar), advances the
grammar and tells the drafter chain. It does not run the forward (``forward.py``) or keep records (``records.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdecode.batch.forward import ForwardResult
from specdecode.batch.sequence import SequenceState
from specdecode.kv.cache import Cache
from specdecode.logprobs import TokenLogprob, token_logprobs, verdict_rows
from specdecode.verify import Pending, Verdict, verify_batch


@dataclass(kw_only=True)
class Accepted:
    """A decoding sequence's outcome of a step.

    Args:
        verdict: what verification kept and emitted.
        logprobs: the emitted tokens' log-probabilities when the request asked for them, else None.
    """

    verdict: Verdict
    logprobs: list[TokenLogprob] | None = None


@dataclass(kw_only=True)
class AcceptedStep:
    """Every decoding sequence's outcome of a step.

    Args:
        accepted: per decoding sequence.
        logprobs_s: seconds the log-probabilities took (kept out of the verification time the controllers learn).
    """

    accepted: dict[SequenceState, Accepted]
    logprobs_s: float = 0.0


def accept(result: ForwardResult, cache: Cache) -> AcceptedStep:
    """Verifies every decoding sequence's draft against ``result``'s logits and rolls each slot back to it."""
    decoding = result.decoding
    verdicts = verify_batch(result.logits, [1 + len(p.draft.tokens) for p in decoding],
                            [Pending(tokens=p.draft.tokens, q=p.draft.q, sampling=p.seq.request.sampling,
                                     seed=p.seq.seed, position=len(p.seq.tokens), generator=p.seq.generator,
                                     parents=p.draft.parents) for p in decoding])
    step = AcceptedStep(accepted={p.seq: Accepted(verdict=v) for p, v in zip(decoding, verdicts)})
    if any(p.seq.request.logprobs is not None for p in decoding):  # most steps: nobody asked
        tick = time.perf_counter()
        _add_logprobs(result, step)
        step.logprobs_s = time.perf_counter() - tick
    for part in decoding:
        kept = keep_rows(cache, part.slot, part.held, step.accepted[part.seq].verdict)
        if result.features is not None:
            start = result.rows.first[part.seq] + len(part.prompt)
            part.seq.drafter.observe(part.held, result.features[[start + r for r in kept]])
    return step


def _add_logprobs(result: ForwardResult, step: AcceptedStep) -> None:
    """The emitted tokens' log-probabilities, for the sequences that asked, from the rows that predicted them."""
    start = 0
    for part in result.decoding:
        asked, accepted = part.seq.request.logprobs, step.accepted[part.seq]
        if asked is not None:
            verdict = accepted.verdict
            predicting = result.logits[[start + r for r in verdict_rows(verdict.accepted, verdict.path)]]
            accepted.logprobs = token_logprobs(predicting, verdict.tokens, asked)
        start += 1 + len(part.draft.tokens)


def keep_rows(cache: Cache, slot: int, held: int, verdict: Verdict) -> list[int]:
    """Rolls a slot back to the fed token and the accepted drafts, which a forward wrote as rows from ``held``
    on; returns the kept rows' offsets from ``held`` (a tree's path moved into place by ``Cache.compact``)."""
    if verdict.path is None:
        cache.trim(slot, held + 1 + verdict.accepted)
        return list(range(verdict.accepted + 1))
    rows = [0] + [1 + node for node in verdict.path]
    cache.compact(slot, held, rows)
    return rows


def commit(seq: SequenceState, verdict: Verdict, cache: Cache) -> list[int]:
    """Commits ``seq``'s verified step: its slot's rows, its tokens (cut where plain decoding stops: EOS, the token
    that completes a stop string or the grammar, the budget), its grammar's place and its drafter chain's state.
    Returns the tokens kept."""
    cache.commit(seq.slot, cache.lengths[seq.slot])  # the fed token and the accepted drafts are verified
    constraint, tokens = seq.constraint, verdict.tokens
    if constraint is not None:
        tokens = tokens[:constraint.until_done(tokens)]
    kept = seq.append(tokens)
    if constraint is not None:
        constraint.advance(kept)
        if constraint.done:
            seq.complete()
    if seq.drafter is not None:
        seq.drafter.commit(seq.tokens)
    return kept
