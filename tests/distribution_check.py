"""The exact-distribution check every sampling test shares: a tiny random target with a 16-token vocabulary,
the exact joint distribution of its first three generated tokens (16 * 16 * 16 = 4096 outcomes, from the
target alone), counts of what an engine samples with SAMPLES seeds, and a chi-square goodness-of-fit test
(outcomes with small expected counts pooled so every bin expects >= 5).

False-failure rate: each case uses significance level ALPHA = 1e-3, so a correct engine fails a given case
with probability 0.1% for a random set of seeds. Seeds are fixed, so a run is reproducible. The test's power
is shown by the negative control in test_distribution.py (the seed document's lossy rule is rejected).
"""

from __future__ import annotations

from dataclasses import replace

from typing import Callable

import torch

from specdecode.engine import Engine, GenerationResult
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import from_hf_tensors
from specdecode.models.rows import LogitRows
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams, probs_from_logits
from tiny_models import random_hf_tensors, tiny_config

ALPHA = 1e-3
SAMPLES = 2000
NEW_TOKENS = 3
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so that n-gram lookup proposes (3, 1, 2 ...)
VOCAB = 16

SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.0, top_k=6),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.9),
    SamplingParams(temperature=0.5, top_p=0.9),
]


def small_vocab_model(seed: int, layers: int = 3) -> Transformer:
    config = tiny_config("llama", vocab_size=VOCAB, num_layers=layers)
    tensors = random_hf_tensors(config, seed)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 0.2  # moderate entropy at T=1: 2.1-2.6 nats
    return from_hf_tensors(config, tensors)


LETTERS = "abcdefghijklmno"  # the small vocabulary's tokens 0..14 as text; token 15 is "<eos>"


def small_vocab_tokenizer():
    """A byte-level tokenizer whose token i is LETTERS[i] (one byte each) and 15 "<eos>": what a grammar needs."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers

    from specdecode.models.tokenizer import Tokenizer
    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate(LETTERS)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<eos>", special=True)])
    return Tokenizer(backend, None, VOCAB - 1)


def small_vocab_compiler():
    """A grammar compiler over ``small_vocab_tokenizer``'s vocabulary."""
    from specdecode.grammar import GrammarCompiler

    tokenizer = small_vocab_tokenizer()
    return GrammarCompiler(tokenizer.backend.to_str(), VOCAB, tokenizer.eos_token_ids)


def letter_ids(text: str) -> list[int]:
    """The small vocabulary's ids of ``text`` (letters of LETTERS)."""
    return [LETTERS.index(c) for c in text]


def small_vocab_target() -> Transformer:
    """The target every distribution test samples from."""
    return small_vocab_model(3)


def next_probs(model: Transformer, seqs: list[list[int]], sampling: SamplingParams,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The next token's distribution after each of ``seqs``, with the tokens outside ``allowed`` ([V] bool) masked
    out of the logits first when given."""
    out = []
    for seq in seqs:
        cache = model.new_cache(CacheConfig(max_len=len(seq)))
        logits = model(torch.tensor([seq]), cache, logits=LogitRows.LAST).logits[0, -1]
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        out.append(probs_from_logits(logits, sampling))
    return torch.stack(out)  # [len(seqs), V]


def exact_joint(model: Transformer, sampling: SamplingParams,
                allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) under the target alone, shape [V, V, V]; with ``allowed``, under a grammar that allows
    those tokens ([V] bool) at each of the three positions, whatever came before."""
    a1, a2, a3 = allowed if allowed is not None else (None, None, None)
    p1 = next_probs(model, [PROMPT], sampling, a1)[0]  # [V]
    p2 = next_probs(model, [PROMPT + [a] for a in range(VOCAB)], sampling, a2)  # [V, V]
    p3 = next_probs(model, [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)], sampling, a3)
    return p1[:, None, None] * p2[:, :, None] * p3.view(VOCAB, VOCAB, VOCAB)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of counts to probs, pooling the least likely outcomes until each bin expects >= 5."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = counts.sum()
    order = probs.argsort()
    expected = probs[order] * n
    observed = counts[order]
    # Pool every outcome expecting < 5 into one bin (topped up by the next outcome if still < 5).
    tail = int((expected < 5).sum())
    if tail and expected[:tail].sum() < 5:
        tail += 1
    exp_bins = torch.cat([expected[:tail].sum()[None], expected[tail:]])
    obs_bins = torch.cat([observed[:tail].sum()[None], observed[tail:]])
    keep = exp_bins > 0
    stat = ((obs_bins[keep] - exp_bins[keep]) ** 2 / exp_bins[keep]).sum()
    df = int(keep.sum()) - 1
    if df == 0:  # a single possible outcome: the fit is perfect or impossible
        return float(stat == 0)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2.0))


def sample_counts(engine: Engine, sampling: SamplingParams, samples: int = SAMPLES,
                  on_result: Callable[[GenerationResult], None] | None = None, **request) -> torch.Tensor:
    """Counts of the first NEW_TOKENS tokens the engine samples after PROMPT, seeds 0..samples-1: [V, V, V]
    (``request``: more arguments of ``Engine.generate``)."""
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    for seed in range(samples):
        params = replace(sampling, seed=seed)
        result = engine.generate(PROMPT, params, max_new_tokens=NEW_TOKENS, eos_token_ids=(), **request)
        counts[tuple(result.token_ids)] += 1
        if on_result is not None:
            on_result(result)
    return counts
