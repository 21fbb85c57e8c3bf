"""Self-speculation: the target drafts with some of its layers skipped, sharing its weights and cache.

The drafted tokens' keys/values are written into the target's own cache for the layers that run and
then overwritten by the verification forward, so the drafter owns no cache. Without training, a
skip set must be chosen with care (see ``calibrate_skip_set``): plain early exit agrees poorly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specdecode.drafters.base import Draft, model_draft
from specdecode.kv.cache import CacheConfig, KVCache
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams
from specdecode.stats import predicted_speedup


def parse_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """Parses "3,5,7-9" into sorted layer indices, checking each is in range."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"layer list {spec!r}: {part!r} is not a number or a range like 3-7") from None
        out.update(range(first, last + 1))
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layer list {spec!r}: layers {bad} are out of range 0..{num_layers - 1}")
    return tuple(sorted(out))


class LayerSkipDrafter:
    """Drafting with the target itself, skipping some layers.

    Args:
        model: the target transformer.
        skip: indices of the layers not run while drafting.
    """

    name = "layerskip"

    def __init__(self, model: Transformer, skip: Sequence[int]) -> None:
        n = model.config.num_layers
        if len(set(skip)) >= n or any(not 0 <= i < n for i in skip):
            raise ValueError(f"skip set {list(skip)} must name some but not all of layers 0..{n - 1}")
        self.model = model
        self.skip = tuple(sorted(set(skip)))
        self.layers = tuple(i for i in range(n) if i not in self.skip)
        self.cache: KVCache | None = None

    def reset(self, target_cache: KVCache) -> None:
        self.cache = target_cache

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator) -> Draft:
        start = self.cache.lengths[0]
        draft = model_draft(self.model, self.cache, seq[start:], k, sampling, generator, layers=self.layers)
        self.cache.trim(0, start)  # leave the target's cache as found; verification rewrites these slots
        return draft

    def commit(self, seq: list[int]) -> None:
        pass


@dataclass
class Calibration:
    """Result of a skip-set search.

    Args:
        skip: the chosen layers to skip.
        agreement: share of positions where the skipping model's argmax equals the full model's.
        predicted_speedup: the DESIGN.md formula at ``gamma`` with draft cost = share of layers run.
        gamma: the draft length the prediction assumes.
        history: (skip set, agreement, predicted speedup) after each accepted removal.
    """

    skip: tuple[int, ...]
    agreement: float
    predicted_speedup: float
    gamma: int
    history: list[tuple[tuple[int, ...], float, float]]


def calibrate_skip_set(model: Transformer, prompts: Sequence[list[int]], new_tokens: int = 48, gamma: int = 4,
                       verify_cost: float = 1.1, progress: Callable[[str], None] | None = None) -> Calibration:
    """Greedy search for the skip set that maximises the predicted speedup.

    Each prompt is first continued greedily by the full model; then the agreement of a candidate skip
    set is the share of those positions where the skipping model (teacher-forced, one forward per
    prompt) picks the same argmax. Layers are removed one at a time, always the removal that predicts
    the highest speedup, until no removal improves it.

    Args:
        model: the target.
        prompts: token ids of a few representative prompts.
        new_tokens: greedy tokens generated per prompt as the reference.
        gamma: draft length the speedup prediction assumes.
        verify_cost: v(gamma), cost of verifying relative to one step (about 1.1 in torch on CPU).
        progress: called with a line of text after each round.
    """
    n = model.config.num_layers
    references = [_greedy_continuation(model, p, new_tokens) for p in prompts]

    def agreement(layers: Sequence[int]) -> float:
        hits = total = 0
        for prompt, full in references:
            cache = model.new_cache(CacheConfig(max_len=len(full)))
            logits = model(torch.tensor([full[:-1]]), cache, layers=layers)[0, len(prompt) - 1:]
            hits += int((logits.argmax(-1) == torch.tensor(full[len(prompt):])).sum())
            total += len(full) - len(prompt)
        return hits / total

    def score(skip: tuple[int, ...]) -> tuple[float, float]:
        a = agreement([i for i in range(n) if i not in skip])
        return a, predicted_speedup(a, gamma, (n - len(skip)) / n, verify_cost)

    best: tuple[int, ...] = ()
    best_a, best_s = 1.0, predicted_speedup(1.0, gamma, 1.0, verify_cost)
    history = []
    while len(best) < n - 1:
        scored = [(score(tuple(sorted(best + (i,)))), i) for i in range(n) if i not in best]
        (a, s), layer = max(scored, key=lambda r: r[0][1])
        if s <= best_s:
            break
        best, best_a, best_s = tuple(sorted(best + (layer,))), a, s
        history.append((best, a, s))
        if progress:
            progress(f"skip {list(best)}: agreement {a:.3f}, predicted speedup {s:.3f}")
    if not best:
        # Even one skipped layer does not pay: report the least harmful one so the caller sees why.
        (a, s), layer = max(((score((i,)), i) for i in range(n)), key=lambda r: r[0][1])
        best, best_a, best_s = (layer,), a, s
    return Calibration(best, best_a, best_s, gamma, history)


def _greedy_continuation(model: Transformer, prompt: list[int], new_tokens: int) -> tuple[list[int], list[int]]:
    cache = model.new_cache(CacheConfig(max_len=len(prompt) + new_tokens))
    seq = list(prompt)
    logits = model(torch.tensor([seq]), cache, logits="last")[0, -1]
    for _ in range(new_tokens):
        seq.append(int(logits.argmax()))
        logits = model(torch.tensor([[seq[-1]]]), cache, logits="last")[0, -1]
    return prompt, seq

