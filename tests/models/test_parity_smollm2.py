"""Our decoder's logits equal transformers' LlamaForCausalLM on the same SmolLM2 weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from specdecode.kv.cache import CacheConfig
from specdecode.models.build import from_hf_tensors
from specdecode.models.loader import load_checkpoint

pytestmark = pytest.mark.integration

# fp32, 30 layers, same weights: differences are summation-order rounding only.
ATOL = 2e-3


def test_logits_match_transformers(smollm2_path):
    transformers = pytest.importorskip("transformers")
    ckpt = load_checkpoint(str(smollm2_path))
    ours = from_hf_tensors(ckpt.config, ckpt.tensors, dtype=torch.float32)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in ckpt.config.to_hf().items()
                                            if k not in ("model_type", "architectures")})
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    state = dict(ckpt.tensors)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)

    ids = ckpt.tokenizer.encode("The quick brown fox jumps over the lazy dog. def fib(n): return n")
    with torch.inference_mode():
        reference = hf(torch.tensor([ids])).logits[0]
        cache = ours.new_cache(CacheConfig(max_len=len(ids)))
        # Prefill most, then decode the rest one by one: exercises the cache path too.
        head = ours(torch.tensor([ids[:-4]]), cache).logits[0]
        tail = [ours(torch.tensor([[t]]), cache).logits[0] for t in ids[-4:]]
    logits = torch.cat([head, *tail])
    assert logits.shape == reference.shape
    err = (logits - reference).abs().max().item()
    assert err < ATOL, f"max |logit difference| {err:.2e} >= {ATOL}"
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))
