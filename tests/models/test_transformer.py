"""The decoder: parity with transformers, incremental decoding, layer subsets, RoPE scaling, config checks,
what a forward hands back (``ForwardOutput``, ``LogitRows``), ragged rows and features.

Parity tolerance: fp32 logits agree with transformers' to 1e-4 absolute (observed ~5e-6 on these
tiny models, whose logits reach ~20 in magnitude).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from specdecode.kv.cache import CacheConfig
from specdecode.models.build import from_hf_tensors, pack_model
from specdecode.models.config import ModelConfig
from specdecode.models import native
from specdecode.models.rope import rope_inv_freq
from specdecode.models.rows import ForwardOutput, LogitRows
from specdecode.models.transformer import Transformer
from kernel_paths import NATIVE_PATHS, path_params, require_path
from tiny_models import random_hf_tensors, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PARITY_ATOL = 1e-4
STEP_ATOL = 1e-4  # our own paths (full vs incremental) differ only by summation order (and thread count)

HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM"}
HF_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig",
              "gemma3": "Gemma3TextConfig"}

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
    return model(ids, cache).logits


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits.float()


# --------------------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("llama", {"num_kv_heads": 4}),  # plain multi-head attention
    ("llama", {"tie_word_embeddings": False}),
    ("qwen2", {}),
    ("qwen3", {}),  # per-head query/key RMSNorm
    ("qwen3", {"tie_word_embeddings": True}),
    ("mistral", {}),
    ("mistral", {"sliding_window": 8}),  # 40 tokens pass the window
    # windows of 8 on layers 0, 1, 3 with their own RoPE base, tanh-GELU, four norms, a query scale, scaled embeddings
    ("gemma3", {}),
    ("gemma3", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}),  # on the full-attention layer only
])
def test_logits_match_transformers(arch, overrides):
    config = tiny_config(arch, **overrides)
    tensors = random_hf_tensors(config, seed=3)
    # HF stores Gemma's norms as w in x * (1 + w); ours take the factor (as GGUF files and load_hf_dir give it)
    ours = from_hf_tensors(config, {n: t + config.norm_offset if n.endswith("norm.weight") else t
                                    for n, t in tensors.items()})
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
    ours = from_hf_tensors(config, tensors)
    hf = _hf_model(config, tensors)
    ids = _ids(80, seed=2)
    want = _hf_logits(hf, ids)
    torch.testing.assert_close(_ours_full(ours, ids), want, atol=PARITY_ATOL, rtol=0)
    # The scaling matters at this size: ignoring it would fail the comparison above.
    unscaled = from_hf_tensors(tiny_config(arch, rope_theta=500.0), tensors)
    assert (_ours_full(unscaled, ids) - want).abs().max() > 100 * PARITY_ATOL


# --------------------------------------------------------------------------- incremental decoding


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request) -> Transformer:
    return tiny_model(request.param)


def test_prefill_then_one_token_at_a_time_equals_full_forward(model):
    ids = _ids(24, seed=7)
    full = _ours_full(model, ids)
    cache = model.new_cache(CacheConfig(max_len=24))
    steps = [model(ids[:, :10], cache).logits]
    for i in range(10, 24):
        steps.append(model(ids[:, i:i + 1], cache).logits)
        assert cache.lengths[0] == i + 1
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=STEP_ATOL, rtol=0)


@pytest.mark.parametrize("chunks", [(1, 5, 2, 9, 7), (12, 12), (3, 3, 3, 3, 3, 3, 3, 3)])
def test_chunked_forwards_equal_full_forward(model, chunks):
    ids = _ids(sum(chunks), seed=8)
    full = _ours_full(model, ids)
    cache = model.new_cache(CacheConfig(max_len=ids.shape[1]))
    out, pos = [], 0
    for n in chunks:
        out.append(model(ids[:, pos:pos + n], cache).logits)
        pos += n
    torch.testing.assert_close(torch.cat(out, dim=1), full, atol=STEP_ATOL, rtol=0)


def test_logits_last_and_none(model):
    ids = _ids(12, seed=9)
    full = _ours_full(model, ids)
    cache = model.new_cache(CacheConfig(max_len=12))
    last = model(ids, cache, logits=LogitRows.LAST)
    assert isinstance(last, ForwardOutput) and last.features is None and last.logits.shape == (1, 1, model.config.vocab_size)
    torch.testing.assert_close(last.logits, full[:, -1:], atol=STEP_ATOL, rtol=0)

    cache = model.new_cache(CacheConfig(max_len=12))
    assert model(ids[:, :8], cache, logits=LogitRows.NONE) == ForwardOutput(None, None)
    assert cache.lengths == [8]  # NONE still writes the cache
    torch.testing.assert_close(model(ids[:, 8:], cache).logits, full[:, 8:], atol=STEP_ATOL, rtol=0)


def test_chosen_rows_are_for_ragged_forwards_only(model):
    cache = model.new_cache(CacheConfig(max_len=12))
    with pytest.raises(ValueError, match="LogitRows.at names rows of a ragged forward"):
        model(_ids(4), cache, logits=LogitRows.at(torch.tensor([1, 3])))
    assert cache.lengths == [0]  # refused before anything was written
    with pytest.raises(ValueError, match="1-D integer tensor of row indices"):
        LogitRows.at(torch.tensor([0.5]))
    rows = model.forward_rows(_ids(4)[0], cache, (0,), (4,), logits=LogitRows.at(torch.tensor([3, 1])))
    torch.testing.assert_close(rows.logits, _ours_full(model, _ids(4))[0, [3, 1]], atol=STEP_ATOL, rtol=0)


def test_positions_matter(model):
    """The same tokens at other positions give other logits (RoPE is applied at the cached offset)."""
    ids = _ids(6, seed=10)
    cache = model.new_cache(CacheConfig(max_len=16))
    model(_ids(5, seed=11), cache, logits=LogitRows.NONE)
    shifted = model(ids, cache).logits
    assert (shifted - _ours_full(model, ids)).abs().max() > 1e-2


# --------------------------------------------------------------------------- layer subsets


def test_layer_subset_equals_model_built_from_those_layers():
    config = tiny_config("qwen2")
    tensors = random_hf_tensors(config, seed=4)
    full = from_hf_tensors(config, tensors)
    keep = [0, 2]
    sub_tensors = {k: v for k, v in tensors.items() if not k.startswith("model.layers.")}
    for j, i in enumerate(keep):
        prefix = f"model.layers.{i}."
        sub_tensors.update({f"model.layers.{j}." + k[len(prefix):]: v for k, v in tensors.items()
                            if k.startswith(prefix)})
    small = from_hf_tensors(tiny_config("qwen2", num_layers=len(keep)), sub_tensors)

    ids = _ids(15, seed=12)
    cache = full.new_cache(CacheConfig(max_len=15))
    got = torch.cat([full(ids[:, :9], cache, layers=keep).logits, full(ids[:, 9:], cache, layers=keep).logits], dim=1)
    torch.testing.assert_close(got, _ours_full(small, ids), atol=STEP_ATOL, rtol=0)
    assert (got - _ours_full(full, ids)).abs().max() > 1e-2
    # Skipped layers' cache entries were not written; run layers' were.
    assert not cache.k[1].any() and not cache.k[3].any()
    assert cache.k[0][0, :, :15].any() and cache.k[2][0, :, :15].any()


# --------------------------------------------------------------------------- loading


def test_from_hf_tensors_dtype_and_no_grad():
    model = tiny_model("llama", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training
    cache = model.new_cache(CacheConfig(max_len=4))
    assert cache.k[0].dtype == torch.bfloat16
    assert model(torch.tensor([[1, 2]]), cache).logits.dtype == torch.float32


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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
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
    ours = from_hf_tensors(config, tensors)
    hf_cfg = {k: v for k, v in config.to_hf().items() if k not in ("model_type", "architectures")}
    hf = MistralForCausalLM(MistralConfig(**hf_cfg, attn_implementation="eager")).eval()
    hf.load_state_dict(tensors, strict=False)
    ids = torch.randint(0, config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = hf(ids).logits[0]
        full = ours(ids, ours.new_cache(CacheConfig(max_len=32))).logits[0]
        cache = ours.new_cache(CacheConfig(max_len=32))
        head = ours(ids[:, :9], cache).logits[0]
        steps = [ours(ids[:, i:i + 1], cache).logits[0] for i in range(9, 16)]
        tail = ours(ids[:, 16:], cache, invariant_rows=True).logits[0]
    torch.testing.assert_close(full, reference, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat([head, *steps, tail]), reference, atol=1e-4, rtol=0)
    unwindowed = from_hf_tensors(tiny_config("mistral", tie_word_embeddings=False), tensors)
    assert not torch.allclose(unwindowed(ids, unwindowed.new_cache(CacheConfig(max_len=32))).logits[0], reference,
                              atol=1e-3)


@pytest.mark.parametrize("path", path_params())
def test_verification_forward_equals_decode_steps_on_every_path(path):
    """One forward over 9 new tokens gives, bitwise, the logits of 9 one-token forwards (a sliding window included)."""
    require_path(path)
    for overrides in ({}, {"sliding_window": 12}):
        config = tiny_config("mistral" if overrides else "llama", tie_word_embeddings=False, **overrides)
        model = from_hf_tensors(config, random_hf_tensors(config, seed=4, scale=0.2), dtype=torch.bfloat16)
        assert pack_model(model, path).name == path
        ours = native.kernel(path) if path in NATIVE_PATHS else None
        assert all(block.attention_ops is ours for block in model.layers)  # our attention kernel on our paths
        assert model.runner.fused == (path in NATIVE_PATHS)  # and on ours, one call per layer
        ids = torch.randint(0, config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            cache = model.new_cache(CacheConfig(max_len=32))
            model(ids[:, :21], cache, logits=LogitRows.NONE)
            batched = model(ids[:, 21:], cache, invariant_rows=True).logits[0]
            cache.trim(0, 21)
            steps = torch.cat([model(ids[:, i:i + 1], cache, invariant_rows=True).logits[0] for i in range(21, 30)])
        assert torch.equal(batched, steps), (path, overrides)


@pytest.mark.parametrize("path", path_params())
def test_ragged_rows_of_several_sequences_equal_each_sequence_alone(path):
    """``forward_rows`` over 3 sequences of different lengths with 1, 4 and 2 new rows gives, bitwise, the
    logits, features and cache entries of each sequence's rows run alone (a batch's verification step)."""
    require_path(path)
    config = tiny_config("llama", tie_word_embeddings=False)
    model = from_hf_tensors(config, random_hf_tensors(config, seed=4, scale=0.2), dtype=torch.bfloat16)
    pack_model(model, path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (5, 17, 9)]
    rows = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (1, 4, 2)]
    features = (1, config.num_layers)
    with torch.inference_mode():
        together = model.new_cache(CacheConfig(max_len=32, slots=3))
        alone = model.new_cache(CacheConfig(max_len=32, slots=3))
        for slot, prompt in enumerate(prompts):
            for cache in (together, alone):
                model(prompt[None], cache, slots=(slot,), logits=LogitRows.NONE)
        out = model.forward_rows(torch.cat(rows), together, (0, 1, 2), (1, 4, 2), features=features)
        singles = [model.forward_rows(r, alone, (slot,), (len(r),), features=features) for slot, r in enumerate(rows)]
        last = model.forward_rows(torch.cat(rows), model.new_cache(CacheConfig(max_len=8, slots=3)), (0, 1, 2),
                                  (1, 4, 2), logits=LogitRows.LAST)
    assert torch.equal(out.logits, torch.cat([s.logits for s in singles])), path
    assert torch.equal(out.features, torch.cat([s.features for s in singles])), path
    assert last.logits.shape == (3, config.vocab_size) and last.features is None
    assert together.lengths == alone.lengths == [6, 21, 11]
    for layer in range(config.num_layers):
        assert torch.equal(together.k[layer], alone.k[layer]) and torch.equal(together.v[layer], alone.v[layer])


def test_features_are_returned_only_when_asked_and_change_nothing():

    model = tiny_model("llama", seed=2)
    n = model.config.num_layers
    ids = torch.tensor([[3, 9, 27, 81, 5]])
    plain = model(ids, model.new_cache(CacheConfig(max_len=16)))
    out = model(ids, model.new_cache(CacheConfig(max_len=16)), features=(1, n))
    assert plain.features is None
    assert torch.equal(out.logits, plain.logits) and out.features.shape == (1, 5, 2 * model.config.hidden_size)
    # The last block: the normed state the output head reads.
    assert torch.allclose(model.head(out.features[..., 64:]).float(), plain.logits)
    # Layer 1's output: what running layers 0 and 1 alone leaves in the residual stream.
    first_two = model(ids, model.new_cache(CacheConfig(max_len=16)), layers=[0, 1], logits=LogitRows.NONE,
                      features=(1,))
    assert first_two.logits is None and torch.equal(out.features[..., :64], first_two.features)
    with pytest.raises(ValueError, match=r"features \[7\] are out of range 0\.\.4"):
        model(ids, model.new_cache(CacheConfig(max_len=16)), features=(7,))
    cache = model.new_cache(CacheConfig(max_len=16))
    with pytest.raises(ValueError, match=r"features \[3\] name layers this forward skips"):
        model(ids, cache, layers=[0, 1], features=(3,))
    assert cache.lengths[0] == 0  # refused before anything was written


def test_gemmas_norm_weights_stay_fp32_in_a_bf16_model():
    """Gemma's norms hold 1 + w: bf16 (a step of 2^-7 near 1) would lose most of a small w. Other models' norm
    weights, and every other parameter, take the model dtype."""
    for arch, norm_dtype in (("gemma3", torch.float32), ("llama", torch.bfloat16)):
        config = tiny_config(arch)
        tensors = random_hf_tensors(config, seed=1)
        tensors["model.layers.0.input_layernorm.weight"][0] = 1.01  # 1.0078125 in bf16
        model = from_hf_tensors(config, tensors, dtype=torch.bfloat16)
        norms = [p for n, p in model.named_parameters() if n.endswith("norm")]
        assert norms and all(p.dtype == norm_dtype for p in norms), arch
        assert model.embed.weight.dtype == torch.bfloat16 and model.layers[0].wqkv.weight.dtype == torch.bfloat16
        assert (model.layers[0].attn_norm[0].item() == torch.tensor(1.01).item()) == (arch == "gemma3")
