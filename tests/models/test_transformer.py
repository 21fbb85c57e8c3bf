"""The decoder: parity with transformers, incremental decoding, layer subsets, RoPE scaling, config checks.

Parity tolerance: fp32 logits agree with transformers' to 1e-4 absolute (observed ~5e-6 on these
tiny models, whose logits reach ~20 in magnitude).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from specdecode.kv.cache import CacheConfig
from specdecode.models.config import ModelConfig
from specdecode.models.linear import can_pack
from specdecode.models import native
from specdecode.models.linear import NATIVE_KERNELS
from specdecode.models.transformer import Transformer, apply_rope, causal_hidden, rope_inv_freq
from kernel_paths import path_params, require_path
from tiny_models import random_hf_tensors, tiny_config, tiny_model, varied_model

pytestmark = pytest.mark.usefixtures("one_thread")

PARITY_ATOL = 1e-4
STEP_ATOL = 1e-4  # our own paths (full vs incremental) differ only by summation order (and thread count)

HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
HF_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
LINEAR = {"rope_type": "linear", "factor": 4.0}


def _transformers():
    """transformers is the parity reference (a dev dependency); only the tests that compare with it need it."""
    return pytest.importorskip("transformers")


def _ids(n: int, seed: int = 1, vocab: int = 97) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _hf_model(config: ModelConfig, tensors: dict[str, torch.Tensor]):
    transformers = _transformers()
    hf_config = getattr(transformers, HF_CONFIGS[config.arch])(**config.to_hf())
    hf_config._attn_implementation = "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, HF_CLASSES[config.arch])(hf_config).eval()
    state = dict(tensors)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert not [m for m in missing if "rotary" not in m], missing
    if config.tie_word_embeddings:
        assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])
    return model


def _ours_full(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(CacheConfig(max_len=ids.shape[1]))
    return model(ids, cache)


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits.float()


# --------------------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("llama", {"num_kv_heads": 4}),  # plain multi-head attention
    ("llama", {"tie_word_embeddings": False}),
    ("qwen2", {}),
    ("mistral", {}),
])
def test_logits_match_transformers(arch, overrides):
    config = tiny_config(arch, **overrides)
    tensors = random_hf_tensors(config, seed=3)
    ours = Transformer.from_hf_tensors(config, tensors)
    hf = _hf_model(config, tensors)
    ids = _ids(40)
    got, want = _ours_full(ours, ids), _hf_logits(hf, ids)
    assert got.dtype == torch.float32 and got.shape == (1, 40, config.vocab_size)
    torch.testing.assert_close(got, want, atol=PARITY_ATOL, rtol=0)
    assert want.abs().max() > 1.0  # logits are not trivially tiny


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("scaling", [LINEAR, LLAMA3], ids=["linear", "llama3"])
def test_rope_scaling_matches_transformers(arch, scaling):
    # A low theta and a short original context put every frequency band (kept, smoothed, scaled)
    # inside the 16-wide head, and 80 positions reach past the original context.
    config = tiny_config(arch, rope_theta=500.0, rope_scaling=dict(scaling))
    tensors = random_hf_tensors(config, seed=5)
    ours = Transformer.from_hf_tensors(config, tensors)
    hf = _hf_model(config, tensors)
    ids = _ids(80, seed=2)
    want = _hf_logits(hf, ids)
    torch.testing.assert_close(_ours_full(ours, ids), want, atol=PARITY_ATOL, rtol=0)
    # The scaling matters at this size: ignoring it would fail the comparison above.
    unscaled = Transformer.from_hf_tensors(tiny_config(arch, rope_theta=500.0), tensors)
    assert (_ours_full(unscaled, ids) - want).abs().max() > 100 * PARITY_ATOL


def test_llama3_inv_freq_bands():
    config = tiny_config(rope_theta=500.0, rope_scaling=dict(LLAMA3))
    plain = rope_inv_freq(tiny_config(rope_theta=500.0))
    scaled = rope_inv_freq(config)
    wavelen = 2 * torch.pi / plain
    high = wavelen < 32 / 4.0  # short wavelengths: unchanged
    low = wavelen > 32 / 1.0  # long wavelengths: divided by factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8.0)
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8.0)).all()


def test_unsupported_rope_scaling_is_refused():
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        rope_inv_freq(tiny_config(rope_scaling={"rope_type": "yarn", "factor": 2.0}))


# --------------------------------------------------------------------------- incremental decoding


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request) -> Transformer:
    return tiny_model(request.param)


def test_prefill_then_one_token_at_a_time_equals_full_forward(model):
    ids = _ids(24, seed=7)
    full = _ours_full(model, ids)
    cache = model.new_cache(CacheConfig(max_len=24))
    steps = [model(ids[:, :10], cache)]
    for i in range(10, 24):
        steps.append(model(ids[:, i:i + 1], cache))
        assert cache.lengths[0] == i + 1
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=STEP_ATOL, rtol=0)


@pytest.mark.parametrize("chunks", [(1, 5, 2, 9, 7), (12, 12), (3, 3, 3, 3, 3, 3, 3, 3)])
def test_chunked_forwards_equal_full_forward(model, chunks):
    ids = _ids(sum(chunks), seed=8)
    full = _ours_full(model, ids)
    cache = model.new_cache(CacheConfig(max_len=ids.shape[1]))
    out, pos = [], 0
    for n in chunks:
        out.append(model(ids[:, pos:pos + n], cache))
        pos += n
    torch.testing.assert_close(torch.cat(out, dim=1), full, atol=STEP_ATOL, rtol=0)


def test_logits_last_and_none(model):
    ids = _ids(12, seed=9)
    full = _ours_full(model, ids)
    cache = model.new_cache(CacheConfig(max_len=12))
    last = model(ids, cache, logits="last")
    assert last.shape == (1, 1, model.config.vocab_size)
    torch.testing.assert_close(last, full[:, -1:], atol=STEP_ATOL, rtol=0)

    cache = model.new_cache(CacheConfig(max_len=12))
    assert model(ids[:, :8], cache, logits="none") is None
    assert cache.lengths == [8]  # "none" still writes the cache
    torch.testing.assert_close(model(ids[:, 8:], cache), full[:, 8:], atol=STEP_ATOL, rtol=0)


def test_positions_matter(model):
    """The same tokens at other positions give other logits (RoPE is applied at the cached offset)."""
    ids = _ids(6, seed=10)
    cache = model.new_cache(CacheConfig(max_len=16))
    model(_ids(5, seed=11), cache, logits="none")
    shifted = model(ids, cache)
    assert (shifted - _ours_full(model, ids)).abs().max() > 1e-2


# --------------------------------------------------------------------------- layer subsets


def test_layer_subset_equals_model_built_from_those_layers():
    config = tiny_config("qwen2")
    tensors = random_hf_tensors(config, seed=4)
    full = Transformer.from_hf_tensors(config, tensors)
    keep = [0, 2]
    sub_tensors = {k: v for k, v in tensors.items() if not k.startswith("model.layers.")}
    for j, i in enumerate(keep):
        prefix = f"model.layers.{i}."
        sub_tensors.update({f"model.layers.{j}." + k[len(prefix):]: v for k, v in tensors.items()
                            if k.startswith(prefix)})
    small = Transformer.from_hf_tensors(tiny_config("qwen2", num_layers=len(keep)), sub_tensors)

    ids = _ids(15, seed=12)
    cache = full.new_cache(CacheConfig(max_len=15))
    got = torch.cat([full(ids[:, :9], cache, layers=keep), full(ids[:, 9:], cache, layers=keep)], dim=1)
    torch.testing.assert_close(got, _ours_full(small, ids), atol=STEP_ATOL, rtol=0)
    assert (got - _ours_full(full, ids)).abs().max() > 1e-2
    # Skipped layers' cache entries were not written; run layers' were.
    assert not cache.k[1].any() and not cache.k[3].any()
    assert cache.k[0][0, :, :15].any() and cache.k[2][0, :, :15].any()


# --------------------------------------------------------------------------- loading


def test_missing_tensor_is_named():
    config = tiny_config("qwen2")
    tensors = random_hf_tensors(config)
    del tensors["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*model\.layers\.2\.mlp\.up_proj\.weight"):
        Transformer.from_hf_tensors(config, tensors)


def test_untied_model_needs_lm_head():
    config = tiny_config("llama", tie_word_embeddings=False)
    tensors = random_hf_tensors(tiny_config("llama", tie_word_embeddings=True))
    with pytest.raises(ValueError, match="lm_head.weight"):
        Transformer.from_hf_tensors(config, tensors)


def test_from_hf_tensors_dtype_and_no_grad():
    model = tiny_model("llama", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training
    cache = model.new_cache(CacheConfig(max_len=4))
    assert cache.k[0].dtype == torch.bfloat16
    assert model(torch.tensor([[1, 2]]), cache).dtype == torch.float32


# --------------------------------------------------------------------------- ModelConfig


@pytest.mark.parametrize("overrides, message", [
    ({"arch": "gpt2"}, r"ModelConfig\.arch='gpt2' is not supported"),
    ({"vocab_size": 0}, r"ModelConfig\.vocab_size must be >= 1, got 0"),
    ({"hidden_size": -1}, r"ModelConfig\.hidden_size must be >= 1, got -1"),
    ({"num_layers": 0}, r"ModelConfig\.num_layers must be >= 1, got 0"),
    ({"num_kv_heads": 0}, r"ModelConfig\.num_kv_heads must be >= 1, got 0"),
    ({"head_dim": 0}, r"ModelConfig\.head_dim must be >= 1, got 0"),
    ({"num_heads": 4, "num_kv_heads": 3}, r"num_heads=4 must be a multiple of num_kv_heads=3"),
])
def test_model_config_validation(overrides, message):
    fields = dict(arch="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)
    fields.update(overrides)
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_config_round_trips_through_hf_dict(arch):
    config = tiny_config(arch, rope_scaling=dict(LINEAR), sliding_window=64 if arch == "mistral" else None)
    back = ModelConfig.from_hf(config.to_hf())
    assert back == config
    assert back.rope_scaling == config.rope_scaling  # not part of ==, so checked on its own


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("scaling", [None, LINEAR, LLAMA3], ids=["default", "linear", "llama3"])
def test_config_from_transformers_saved_dict(arch, scaling):
    """transformers 5 writes RoPE settings as ``rope_parameters`` (no ``rope_scaling``); nothing may be lost."""
    config = tiny_config(arch, rope_theta=500.0, rope_scaling=dict(scaling) if scaling else None)
    saved = getattr(_transformers(), HF_CONFIGS[arch])(**config.to_hf()).to_dict()
    back = ModelConfig.from_hf(saved)
    assert back == config
    assert torch.equal(rope_inv_freq(back), rope_inv_freq(config))


def test_config_from_hf_refuses_other_families():
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        ModelConfig.from_hf({"model_type": "gpt2"})


def test_config_from_hf_defaults():
    c = ModelConfig.from_hf({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                             "num_hidden_layers": 1, "num_attention_heads": 2, "sliding_window": 32})
    assert (c.num_kv_heads, c.head_dim, c.attention_bias, c.sliding_window) == (2, 4, True, None)
    m = ModelConfig.from_hf({"model_type": "mistral", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                             "sliding_window": 32})
    assert (m.num_kv_heads, m.attention_bias, m.sliding_window) == (1, False, 32)


def test_mistral_sliding_window_matches_transformers():
    """Past the window, each query sees only the last `sliding_window` keys, as in MistralForCausalLM."""
    from transformers import MistralConfig, MistralForCausalLM

    config = tiny_config("mistral", sliding_window=6, tie_word_embeddings=False, attention_bias=False)
    tensors = random_hf_tensors(config, seed=5, scale=0.2)
    ours = Transformer.from_hf_tensors(config, tensors)
    hf_cfg = {k: v for k, v in config.to_hf().items() if k not in ("model_type", "architectures")}
    hf = MistralForCausalLM(MistralConfig(**hf_cfg, attn_implementation="eager")).eval()
    hf.load_state_dict(tensors, strict=False)
    ids = torch.randint(0, config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = hf(ids).logits[0]
        full = ours(ids, ours.new_cache(CacheConfig(max_len=32)))[0]
        cache = ours.new_cache(CacheConfig(max_len=32))
        head = ours(ids[:, :9], cache)[0]
        steps = [ours(ids[:, i:i + 1], cache)[0] for i in range(9, 16)]
        tail = ours(ids[:, 16:], cache, invariant_rows=True)[0]
    torch.testing.assert_close(full, reference, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat([head, *steps, tail]), reference, atol=1e-4, rtol=0)
    unwindowed = Transformer.from_hf_tensors(tiny_config("mistral", tie_word_embeddings=False), tensors)
    assert not torch.allclose(unwindowed(ids, unwindowed.new_cache(CacheConfig(max_len=32)))[0], reference, atol=1e-3)


def test_rope_roll_equals_rotate_half_bitwise():
    """The roll with a pre-negated sine half is the rotate-half formula, to the bit."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5, 3, 8, generator=g).to(torch.bfloat16)  # [B, T, H, D]
    angles = torch.randn(5, 4, generator=g)
    cos = torch.cat((angles, angles), -1).cos().to(torch.bfloat16)[None, :, None]  # [1, T, 1, D]
    sin = torch.cat((angles, angles), -1).sin().to(torch.bfloat16)[None, :, None]
    rotated = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    signed_sin = torch.cat((-sin[..., :4], sin[..., 4:]), dim=-1)
    assert torch.equal(apply_rope(x, cos, signed_sin), x * cos + rotated * sin)


def _attention_on(path: str):
    """The row-invariant attention a model packed for ``path`` runs (``Block.attend``), as a function."""
    require_path(path)
    block = varied_model(0, dtype=torch.bfloat16).layers[0]
    ops = native.kernel(path) if path in NATIVE_KERNELS else None

    def attend(q, keys, values, window=None):
        block.attention_ops, block.window, block.head_dim = ops, window, q.shape[-1]
        return block.attend(q, keys, values)
    return attend


def _reference_attention(q, keys, values, window=None):
    """float64, each new token over its own (windowed) keys."""
    t, length = q.shape[2], keys.shape[2]
    group = q.shape[1] // keys.shape[1]
    k, v = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    scores = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # [B, H, T, L]
    query_pos = torch.arange(length - t, length)[:, None]
    key_pos = torch.arange(length)[None, :]
    hidden = (key_pos > query_pos) | ((key_pos <= query_pos - window) if window else False)
    return scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("path", path_params())
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (12, 2, 128), (14, 2, 64)])  # SmolLM2, Qwen 1.5B / 0.5B
def test_attention_rows_do_not_depend_on_the_call(path, heads, kv_heads, head_dim):
    """Each new token's attention equals, bitwise, a call with only that token over only its keys, on every
    path, for 1..32 new tokens and contexts up to 4,096 keys, with and without a sliding window.

    This is what lets one verification forward reproduce token-by-token decoding exactly (bf16).
    """
    attend = _attention_on(path)
    g = torch.Generator().manual_seed(heads)
    cases = [(5, 2, None), (63, 5, None), (300, 1, None), *[(700, t, None) for t in range(2, 33, 3)], (4064, 32, None),
             (4095, 1, None), (2000, 17, 512)]
    for start, t, window in cases:
        keys = torch.randn(1, kv_heads, start + t, head_dim, generator=g).to(torch.bfloat16)
        values = torch.randn(1, kv_heads, start + t, head_dim, generator=g).to(torch.bfloat16)
        q = torch.randn(1, heads, t, head_dim, generator=g).to(torch.bfloat16)
        batched = attend(q, keys, values, window)
        assert batched.shape == q.shape and batched.dtype == torch.bfloat16
        # bf16 output of a float32 computation: within a few bf16 steps of the exact result
        assert (batched.double() - _reference_attention(q, keys, values, window)).abs().max() < 0.02, (start, t)
        for i in range(t):
            end = start + i + 1
            lo = 0 if window is None else max(0, end - window)
            alone = attend(q[:, :, i:i + 1], keys[:, :, lo:end], values[:, :, lo:end], window)
            assert torch.equal(batched[:, :, i:i + 1], alone), (path, start, t, i)


@pytest.mark.parametrize("path", path_params())
def test_verification_forward_equals_decode_steps_on_every_path(path):
    """One forward over 9 new tokens gives, bitwise, the logits of 9 one-token forwards (a sliding window included)."""
    require_path(path)
    for overrides in ({}, {"sliding_window": 12}):
        config = tiny_config("mistral" if overrides else "llama", tie_word_embeddings=False, **overrides)
        model = Transformer.from_hf_tensors(config, random_hf_tensors(config, seed=4, scale=0.2), dtype=torch.bfloat16)
        assert model.pack_weights(path) == path
        ours = native.kernel(path) if path in NATIVE_KERNELS else None
        assert all(block.attention_ops is ours for block in model.layers)  # our attention kernel on our paths
        assert all(block.fused_ops is ours for block in model.layers)  # and on ours, one call per layer
        ids = torch.randint(0, config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            cache = model.new_cache(CacheConfig(max_len=32))
            model(ids[:, :21], cache, logits="none")
            batched = model(ids[:, 21:], cache, invariant_rows=True)[0]
            cache.trim(0, 21)
            steps = torch.cat([model(ids[:, i:i + 1], cache, invariant_rows=True)[0] for i in range(21, 30)])
        assert torch.equal(batched, steps), (path, overrides)


@pytest.mark.parametrize("path", path_params())
def test_ragged_rows_of_several_sequences_equal_each_sequence_alone(path):
    """``forward_rows`` over 3 sequences of different lengths with 1, 4 and 2 new rows gives, bitwise, the
    logits, features and cache entries of each sequence's rows run alone (a batch's verification step)."""
    require_path(path)
    config = tiny_config("llama", tie_word_embeddings=False)
    model = Transformer.from_hf_tensors(config, random_hf_tensors(config, seed=4, scale=0.2), dtype=torch.bfloat16)
    model.pack_weights(path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (5, 17, 9)]
    rows = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (1, 4, 2)]
    features = (1, config.num_layers)
    with torch.inference_mode():
        together = model.new_cache(CacheConfig(max_len=32, slots=3))
        alone = model.new_cache(CacheConfig(max_len=32, slots=3))
        for slot, prompt in enumerate(prompts):
            for cache in (together, alone):
                model(prompt[None], cache, slots=(slot,), logits="none")
        logits, hidden = model.forward_rows(torch.cat(rows), together, (0, 1, 2), (1, 4, 2), features=features)
        singles = [model.forward_rows(r, alone, (slot,), (len(r),), features=features) for slot, r in enumerate(rows)]
        last = model.forward_rows(torch.cat(rows), model.new_cache(CacheConfig(max_len=8, slots=3)), (0, 1, 2),
                                  (1, 4, 2), logits="last")
    assert torch.equal(logits, torch.cat([s[0] for s in singles])), path
    assert torch.equal(hidden, torch.cat([s[1] for s in singles])), path
    assert last.shape == (3, config.vocab_size)
    assert together.lengths == alone.lengths == [6, 21, 11]
    for layer in range(config.num_layers):
        assert torch.equal(together.k[layer], alone.k[layer]) and torch.equal(together.v[layer], alone.v[layer])


@pytest.mark.parametrize("slots, counts", [((0, 0), (1, 1)), ((0, 1), (2,)), ((0, 1), (0, 3)), ((0, 1), (1, 1))])
def test_forward_rows_refuses_counts_that_do_not_match(slots, counts):
    model = varied_model(0)
    with pytest.raises(ValueError, match="distinct slots and a count >= 1"):
        model.forward_rows(torch.zeros(3, dtype=torch.long), model.new_cache(CacheConfig(max_len=8, slots=2)), slots,
                           counts)


def test_causal_hidden_mask():
    hidden = causal_hidden(2, 4, group=2)  # new tokens at positions 2, 3
    expected = torch.tensor([[False, False, False, True], [False, False, False, False]])
    assert torch.equal(hidden, torch.cat([expected, expected]))
    assert causal_hidden(1, 4, group=3) is None  # one new token sees everything


@pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="needs oneDNN bf16 on CPU")
@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_packed_model_gives_the_same_logits(arch, tied):
    config = tiny_config(arch, tie_word_embeddings=tied)
    tensors = random_hf_tensors(config, seed=3, scale=0.2)
    plain = Transformer.from_hf_tensors(config, tensors, dtype=torch.bfloat16)
    packed = Transformer.from_hf_tensors(config, tensors, dtype=torch.bfloat16)
    before = packed.weight_nbytes
    assert packed.pack_weights("onednn") == "onednn" and packed.pack_weights("onednn") == "onednn"  # idempotent
    head = config.vocab_size * config.hidden_size * 2
    assert packed.weight_nbytes == before + (head if tied else 0)  # a tied head gains a packed copy
    ids = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = plain(ids, plain.new_cache(CacheConfig(max_len=16)))
        got = packed(ids, packed.new_cache(CacheConfig(max_len=16)))
    assert torch.equal(got, want)


def test_pack_weights_is_a_no_op_in_float32():
    model = tiny_model("llama")
    assert model.weight_nbytes > 0 and model.pack_weights() == "torch" and model.head_layer is None


def test_features_are_returned_only_when_asked_and_change_nothing():

    model = tiny_model("llama", seed=2)
    n = model.config.num_layers
    ids = torch.tensor([[3, 9, 27, 81, 5]])
    plain = model(ids, model.new_cache(CacheConfig(max_len=16)))
    logits, hidden = model(ids, model.new_cache(CacheConfig(max_len=16)), features=(1, n))
    assert torch.equal(logits, plain) and hidden.shape == (1, 5, 2 * model.config.hidden_size)
    # The last block: the normed state the output head reads.
    assert torch.allclose(model.head(hidden[..., 64:]).float(), plain)
    # Layer 1's output: what running layers 0 and 1 alone leaves in the residual stream.
    _, first_two = model(ids, model.new_cache(CacheConfig(max_len=16)), layers=[0, 1], logits="none", features=(1,))
    assert torch.equal(hidden[..., :64], first_two)
    with pytest.raises(ValueError, match=r"features \[7\] are out of range 0\.\.4"):
        model(ids, model.new_cache(CacheConfig(max_len=16)), features=(7,))
    cache = model.new_cache(CacheConfig(max_len=16))
    with pytest.raises(ValueError, match=r"features \[3\] name layers this forward skips"):
        model(ids, cache, layers=[0, 1], features=(3,))
    assert cache.lengths[0] == 0  # refused before anything was written
