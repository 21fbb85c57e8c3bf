"""Self-speculation: the target drafts with some of its layers skipped, sharing its weights and cache.

The drafted tokens' keys/values are written into the target's own cache, in the sequence's slot (a batch
has one such drafter per slot), for the layers that run and then overwritten by the verification forward, so the drafter owns no cache (its KV memory is zero) and
never touches the skipped layers' entries. Drafted tokens stay unverified, so a compressing target cache
never quantizes or evicts them. Without training, a skip set must be chosen with care (see
``calibrate_skip_set``): plain early exit agrees poorly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specdecode.drafters.base import MODEL_SIGNALS, Draft, DrafterBase, StopRule, model_draft
from specdecode.drafters.registry import DrafterInputs, DrafterSpec, Needs, register
from specdecode.kv.cache import Cache, CacheConfig
from specdecode.kv.memory import KVMemory
from specdecode.models.rows import LogitRows
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams, argmax_ids
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
        if last < first:
            raise ValueError(f"layer list {spec!r}: range {part!r} runs backwards; write it as {last}-{first}")
        out.update(range(first, last + 1))
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layer list {spec!r}: layers {bad} are out of range 0..{num_layers - 1}")
    return tuple(sorted(out))


class LayerSkipDrafter(DrafterBase):
    """Drafting with the target itself, skipping some layers.

    Args:
        model: the target transformer.
        skip: indices of the layers not run while drafting.
    """

    name = "layerskip"
    signal_names = MODEL_SIGNALS

    def __init__(self, model: Transformer, skip: Sequence[int]) -> None:
        n = model.config.num_layers
        if len(set(skip)) >= n or any(not 0 <= i < n for i in skip):
            raise ValueError(f"skip set {list(skip)} must name some but not all of layers 0..{n - 1}")
        self.model = model
        self.skip = tuple(sorted(set(skip)))
        self.layers = tuple(i for i in range(n) if i not in self.skip)
        self.cache: Cache | None = None
        self.slot = 0  # the sequence's slot in the target's cache, given by reset

    def reset(self, target_cache: Cache, prompt: Sequence[int] = (), memory: KVMemory | None = None,
              slot: int = 0) -> None:
        self.cache, self.slot = target_cache, slot

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator,
                stop: StopRule | None = None) -> Draft:
        start = self.cache.lengths[self.slot]
        draft = model_draft(self.model, self.cache, seq[start:], k, sampling, generator, layers=self.layers, stop=stop,
                            slot=self.slot)
        self.cache.trim(self.slot, start)  # leave the target's cache as found; verification rewrites these rows
        return draft



@dataclass
class Calibration:
    """Result of a skip-set search.

    Args:
        skip: the chosen layers to skip.
        agreement: share of positions where the skipping model's argmax equals the full model's.
        predicted_speedup: E / (k*c + v(k)) at ``gamma`` with draft cost = share of layers run.
        gamma: the draft length the prediction assumes.
        history: (skip set, agreement, predicted speedup) for each candidate tried, in order.
    """

    skip: tuple[int, ...]
    agreement: float
    predicted_speedup: float
    gamma: int
    history: list[tuple[tuple[int, ...], float, float]]


def block_influence(model: Transformer, sequences: Sequence[list[int]]) -> list[float]:
    """How much each layer changes the residual stream: mean over tokens of 1 - cos(input, output).

    A layer that barely turns the hidden state (ShortGPT's "block influence") is the cheapest to skip.
    """
    n = model.config.num_layers
    sums = [0.0] * n
    count = 0
    hooks = []
    for i, block in enumerate(model.layers):
        def hook(module, args, out, i=i):
            sums[i] += float((1 - torch.cosine_similarity(args[0].float(), out.float(), dim=-1)).sum())
        hooks.append(block.register_forward_hook(hook))
    try:
        for seq in sequences:
            model(torch.tensor([seq], device=model.device), model.new_cache(CacheConfig(max_len=len(seq))),
                  logits=LogitRows.NONE)
            count += len(seq)
    finally:
        for h in hooks:
            h.remove()
    return [x / count for x in sums]


def calibrate_skip_set(model: Transformer, prompts: Sequence[list[int]], new_tokens: int = 48, gamma: int = 4,
                       verify_cost: float = 1.1, min_agreement: float = 0.3, candidates_per_round: int = 8,
                       progress: Callable[[str], None] | None = None) -> Calibration:
    """Searches the skip set that maximises the predicted speedup.

    Greedy forward selection: each round drops one more layer, the one (among the
    ``candidates_per_round`` remaining layers of least block influence) whose removal keeps agreement
    highest. Agreement: each prompt is continued greedily by the full model, then the skipping model
    (teacher-forced, one forward per prompt) must pick the same argmax. The search goes on past rounds
    that predict no gain (a larger skip set may pay where a small one does not) until agreement falls
    below ``min_agreement``, then returns the best-scoring set along the way. The score of a drafter that runs on the target's own
    cache (as :class:`LayerSkipDrafter` does) is somewhat higher than this teacher-forced estimate.

    Args:
        model: the target.
        prompts: token ids of a few representative prompts.
        new_tokens: greedy tokens generated per prompt as the reference.
        gamma: draft length the speedup prediction assumes.
        verify_cost: v(gamma), cost of verifying relative to one step (about 1.1 in torch on CPU).
        min_agreement: stop adding layers to the skip set below this agreement.
        candidates_per_round: layers tried per round (bounds the cost to about this many forwards per
            prompt and round).
        progress: called with a line of text after each candidate.
    """
    n = model.config.num_layers
    references = [_greedy_continuation(model, p, new_tokens) for p in prompts]

    def agreement(layers: Sequence[int]) -> float:
        hits = total = 0
        for prompt, full in references:
            cache = model.new_cache(CacheConfig(max_len=len(full)))
            out = model(torch.tensor([full[:-1]], device=model.device), cache, layers=layers)
            logits = out.logits[0, len(prompt) - 1:]
            hits += int((argmax_ids(logits) == torch.tensor(full[len(prompt):], device=model.device)).sum())
            total += len(full) - len(prompt)
        return hits / total

    influence = block_influence(model, [full for _, full in references])
    skip: tuple[int, ...] = ()
    history = []
    while len(skip) < n - 1:
        # Greedy: of the least influential remaining layers, drop the one that keeps agreement highest.
        candidates = sorted((i for i in range(n) if i not in skip), key=lambda i: influence[i])[:candidates_per_round]
        scored = [(agreement([j for j in range(n) if j not in skip and j != i]), i) for i in candidates]
        a, layer = max(scored)
        skip = tuple(sorted(skip + (layer,)))
        s = predicted_speedup(a, gamma, (n - len(skip)) / n, verify_cost)
        history.append((skip, a, s))
        if progress:
            progress(f"skip {list(skip)}: agreement {a:.3f}, predicted speedup {s:.3f}")
        if a < min_agreement:
            break
    skip, a, s = max(history, key=lambda h: h[2])
    return Calibration(skip, a, s, gamma, history)


def _greedy_continuation(model: Transformer, prompt: list[int], new_tokens: int) -> tuple[list[int], list[int]]:
    cache = model.new_cache(CacheConfig(max_len=len(prompt) + new_tokens))
    seq = list(prompt)
    logits = model(torch.tensor([seq], device=model.device), cache, logits=LogitRows.LAST).logits[0, -1]
    for _ in range(new_tokens):
        seq.append(int(argmax_ids(logits)))
        logits = model(torch.tensor([[seq[-1]]], device=model.device), cache, logits=LogitRows.LAST).logits[0, -1]
    return prompt, seq


def _build(inputs: DrafterInputs) -> LayerSkipDrafter:
    if not inputs.skip_layers:
        raise ValueError("drafter 'layerskip' needs a set of layers to skip")
    return LayerSkipDrafter(inputs.target, inputs.skip_layers)


register(DrafterSpec("layerskip", _build, "the target with some layers skipped (self-speculation)", Needs.SKIP_SET,
                     flags=("--skip-layers",)))
