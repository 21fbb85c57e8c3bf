"""The Qwen pair (0.5B drafting for 1.5B): greedy speculation reproduces plain greedy decoding.

On the tiled kernel (the default where it runs) every row is computed alike at any row count, so the
outputs must be identical. bf16 matmuls of this size are not row-invariant in oneDNN (the fallback: a
row's result depends on how many rows share the call), so there verification of k+1 tokens may round
differently from one-token decoding, and an output may differ only where the plain path itself had a
numerical tie: the top two logits within two bf16 ulps. Any other divergence fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.drafters import DraftModelDrafter
from specdecode.drafters.draft_model import check_same_vocabulary, draft_vocabulary
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import load_model
from specdecode.models.rows import LogitRows
from real_prompts import ALL

pytestmark = [pytest.mark.slow, pytest.mark.integration]

NEW_TOKENS = 64


def bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0 ** -133


@pytest.fixture(scope="module")
def pair():
    return load_model("qwen2.5-coder-1.5b-instruct"), load_model("qwen2.5-coder-0.5b-instruct")


def top2_gap(model, ids: list[int]) -> tuple[float, float]:
    cache = model.new_cache(CacheConfig(max_len=len(ids)))
    top = model(torch.tensor([ids]), cache, logits=LogitRows.LAST).logits[0, -1].topk(2).values.tolist()
    return top[0], top[0] - top[1]


@pytest.mark.parametrize("draft_vocab", [0, 65536], ids=["whole-vocabulary", "draft-vocabulary"])
def test_draft_pair_greedy_matches_plain(pair, draft_vocab):
    target, draft = pair
    check_same_vocabulary(target.tokenizer.vocab(), draft.tokenizer.vocab(),
                          target.model.config.vocab_size, draft.model.config.vocab_size)
    tok = target.tokenizer
    plain = Engine(target.model, tok)
    vocab = draft_vocabulary(draft.model, draft_vocab, tuple(tok.eos_token_ids))
    spec = Engine(target.model, tok, DraftModelDrafter(draft.model, vocab=vocab), SpeculativeConfig(gamma=4))
    identical, accepted = 0, 0
    for text in ALL:
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        expected = plain.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_ids=()).token_ids
        result = spec.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_ids=())
        accepted += result.stats.accepted_tokens
        got = result.token_ids
        if target.model.backend.name == "tiled":
            assert got == expected, text[:40]
        if got == expected:
            identical += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        top, gap = top2_gap(target.model, prompt + expected[:i])
        assert gap <= 2 * bf16_ulp(top), f"{text[:40]!r}: diverged at token {i} where the top-2 gap was {gap}"
    assert accepted > 0
    print(f"identical outputs: {identical}/{len(ALL)}")
