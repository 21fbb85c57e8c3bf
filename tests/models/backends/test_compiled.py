"""Our compiled kernels' backend (``backends/compiled.py``): the fused decoder layer (``kernels/layer.h``) against a
float64 reference of the same steps, its two forms (plain cache written in the kernel, other caches through
``update``) giving the same bits, thread counts giving the same bits, and what a fused model hands out (features,
weight formats)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdecode.kv.cache import CacheConfig
from specdecode.models.build import pack_model
from specdecode.models.config import Activation
from specdecode.models.prefill import _Recorder
from specdecode.models.linear import NativeLinear, QuantLinear
from specdecode.models.rows import LogitRows, plan_rows
from specdecode.models.weights import BLOCK_FORMATS
from kernel_paths import NATIVE_PATHS, block_activations, path_params
from tiny_models import tiny_model, varied_model

pytestmark = pytest.mark.usefixtures("one_thread")
FORMATS = ["bf16", *BLOCK_FORMATS]


def _inputs(layer, x: torch.Tensor) -> torch.Tensor:
    """What a projection reads of fp64 rows x: bf16-rounded values, or int8 blocks of 32 (kernel's scale)."""
    return x.to(torch.bfloat16).double() if isinstance(layer, NativeLinear) else block_activations(x)


def _project(layer, x: torch.Tensor) -> torch.Tensor:
    w = layer.weight_rows(torch.arange(layer.out_features)).double()
    y = _inputs(layer, x) @ w.T
    return y if layer.bias is None else y + layer.bias.double()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def _reference_layer(block, x: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor, positions: torch.Tensor,
                     inv_freq: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer in float64 over rows x [T, h] after past keys/values [Hkv, P, D] (bf16 values): (x', k, v)."""
    t, heads, kv, d = x.shape[0], block.heads, block.kv_heads, block.head_dim
    qkv = _project(block.wqkv, _rms(x, block.attn_norm, eps)).view(t, heads + 2 * kv, d)
    if block.q_norm is not None:  # Qwen3: each query and key head normed before RoPE
        qkv = torch.cat([_rms(qkv[:, :heads], block.q_norm, eps), _rms(qkv[:, heads:heads + kv], block.k_norm, eps),
                         qkv[:, heads + kv:]], dim=1)
    angles = positions[:, None].double() * inv_freq.double()[None]  # [T, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    a, b = qkv[..., :d // 2], qkv[..., d // 2:]
    rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    q, k = rotated[:, :heads], rotated[:, heads:heads + kv]
    v = qkv[:, heads + kv:]
    keys = torch.cat([past_k, k.transpose(0, 1).to(torch.bfloat16).double()], dim=1)  # the cache holds bf16
    values = torch.cat([past_v, v.transpose(0, 1).to(torch.bfloat16).double()], dim=1)
    group, start = heads // kv, past_k.shape[1]
    out = torch.empty(t, heads, d, dtype=torch.float64)
    for i in range(t):
        end = start + i + 1
        first = 0 if block.window is None else max(0, end - block.window)  # a sliding window's first key
        for h in range(heads):
            scores = keys[h // group, first:end] @ q[i, h] * block.scale
            out[i, h] = scores.softmax(-1) @ values[h // group, first:end]
    attn = _project(block.wo, out.reshape(t, -1))
    x = x + (attn if block.post_attn_norm is None else _rms(attn, block.post_attn_norm, eps))
    gate, up = _project(block.w_gate_up, _rms(x, block.mlp_norm, eps)).chunk(2, dim=-1)
    act = F.silu(gate) if block.activation == Activation.SILU else F.gelu(gate, approximate="tanh")
    mlp = _project(block.w_down, act * up)
    return x + (mlp if block.post_mlp_norm is None else _rms(mlp, block.post_mlp_norm, eps)), keys, values


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
@pytest.mark.parametrize("weights", FORMATS)
# qwen2: q/k/v biases; qwen3: q/k norms; gemma3: a window on layers 0, 1, 3, their own RoPE base, tanh-GELU, a
# query scale, norms after attention and the MLP
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_fused_layers_compute_the_float64_reference(path, weights, arch):
    model = tiny_model(arch, seed=3, dtype=torch.bfloat16)
    for block in model.layers:  # norm weights far from 1, so that a skipped or misplaced norm shows
        for n, norm in enumerate((block.q_norm, block.k_norm, block.post_attn_norm, block.post_mlp_norm)):
            if norm is not None:
                norm.data.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(5 + n))
    assert pack_model(model, path, weights=weights).row_invariant
    assert model.runner.fused
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, model.config.vocab_size, (11,), generator=g)
    cache = model.new_cache(CacheConfig(max_len=32))
    with torch.inference_mode():
        model.forward_rows(tokens[:7], cache, (0,), (7,), logits=LogitRows.NONE)
        x = torch.randn(4, model.config.hidden_size, generator=g)
        plan = plan_rows(cache, (0,), (4,), 4, None, None, model.device)  # positions 7..10
        for i, block in enumerate(model.layers):
            past_k = cache.k[i][0, :, :7].double()
            past_v = cache.v[i][0, :, :7].double()
            got, _ = model.runner.run(x, cache, plan, [i], ())
            want, keys, values = _reference_layer(block, x.double(), past_k, past_v, torch.arange(7, 11),
                                                  model.rope.inv_freq[model.rope.kind[i]], model.config.rms_norm_eps)
            # Seen: ~1e-7 (fp32 arithmetic). The bound leaves room for an activation code (or a bf16 input)
            # rounded the other way near a tie (~1e-3; Gemma's post-norms scale a projection's output, and such a
            # flip with it, to unit RMS: 1.2e-2 seen on q8_0, one o-projection input code of one row, checked);
            # a wrong step (RoPE angle, head mapping, bias, window, activation) is ~1e-1.
            err = (got.double() - want).abs().max().item()
            bound = 2e-2 if block.post_attn_norm is not None else 3e-3
            assert err <= bound * want.abs().max().item(), (i, err)
            new_k = cache.k[i][0, :, 7:11].double()
            assert (new_k - keys[:, 7:]).abs().max().item() <= 3e-3 * keys.abs().max().item()
            x = got


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
@pytest.mark.parametrize("weights", ["bf16", "q4_1"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: per-layer windows, RoPE tables and post-norms
@pytest.mark.parametrize("n", [20, 40])  # 40: past kShareRows, layer_rows's threads share the per-row work
def test_a_cache_that_sees_every_write_gives_the_same_bits(path, weights, arch, n):
    """layer_rows writes a plain cache's buffers itself; through update (a recorder, a compressing cache) the
    layer takes its other form: same logits, same cached keys."""
    model = varied_model(0, dtype=torch.bfloat16, arch=arch)
    pack_model(model, path, weights=weights)
    tokens = torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(1))
    torch.set_num_threads(2)  # rows split between the threads where they share the work
    try:
        with torch.inference_mode():
            direct, recorded = model.new_cache(CacheConfig(max_len=48)), model.new_cache(CacheConfig(max_len=48))
            recorder = _Recorder(recorded)
            assert direct.direct_buffers((0,), (0,), (0,), (n,)) is not None and recorder.direct_buffers((0,)) is None
            a = model.forward_rows(tokens, direct, (0,), (n,))
            b = model.forward_rows(tokens, recorder, (0,), (n,))
    finally:
        torch.set_num_threads(1)
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(x, y) for x, y in zip(direct.k, recorded.k))


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
@pytest.mark.parametrize("weights", ["bf16", "q8_0"])
def test_ragged_slots_and_a_tree_give_the_same_bits_in_both_forms(path, weights):
    """Two sequences in one forward, one of them a token tree: the all-layers call over a plain cache and the
    per-layer ``update`` form agree on every logit and every cached key."""
    model = varied_model(0, dtype=torch.bfloat16)
    pack_model(model, path, weights=weights)
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        outs, caches = [], []
        for recorded in (False, True):
            cache = model.new_cache(CacheConfig(max_len=48, slots=2))
            target = _Recorder(cache) if recorded else cache
            g.manual_seed(4)
            for slot, n in ((0, 11), (1, 17)):
                model.forward_rows(torch.randint(0, 97, (n,), generator=g), target, (slot,), (n,), logits=LogitRows.NONE)
            tokens = torch.randint(0, 97, (3 + 5,), generator=g)
            outs.append(model.forward_rows(tokens, target, (0, 1), (3, 5), parents=[None, [-1, 0, 0, 1, 2]]).logits)
            caches.append(cache)
        assert torch.equal(*outs)
        assert all(torch.equal(a, b) for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v))


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: the post-MLP norm's rows split across threads
@pytest.mark.parametrize("n", [13, 40])  # 40: the per-row work split across threads too
def test_fused_forwards_give_the_same_bits_on_one_and_two_threads(path, arch, n):
    model = varied_model(0, dtype=torch.bfloat16, arch=arch)
    pack_model(model, path, weights="q8_0")
    tokens = torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(2))
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            outs.append(model.forward_rows(tokens, model.new_cache(CacheConfig(max_len=n + 3)), (0,), (n,)).logits)
    torch.set_num_threads(1)
    assert torch.equal(*outs)


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
def test_a_fused_model_hands_out_features_in_its_dtype_and_unfused_packing_stays_available(path):
    fused, plain = varied_model(0, dtype=torch.bfloat16), varied_model(0, dtype=torch.bfloat16)
    pack_model(fused, path, weights="q4_1")
    pack_model(plain, path, weights="q4_1", fuse=False)
    assert fused.runner.fused and not plain.runner.fused and isinstance(plain.layers[0].wqkv, QuantLinear)
    assert plain.backend == fused.backend and all(block.attention_ops is not None for block in plain.layers)
    tokens = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        out = fused(tokens, fused.new_cache(CacheConfig(max_len=16)), features=(1, 4))
        unfused = plain(tokens, plain.new_cache(CacheConfig(max_len=16)), invariant_rows=True).logits
    logits, feats = out.logits, out.features
    assert logits.dtype == torch.float32 and feats.dtype == torch.bfloat16 and feats.shape == (1, 9, 2 * 64)
    assert (logits.argmax(-1) == unfused.argmax(-1)).float().mean() > 0.8  # same model, other rounding steps


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: each run of layers reads its layers' RoPE tables
def test_kept_layers_cut_the_fused_forward_without_changing_a_bit(path, arch):
    """Features of middle layers (an EAGLE-3 head's) come from runs of layers cut after each kept one: the
    logits stay bitwise those of the uncut forward, and a kept layer's output is that of a forward ending there."""
    model = varied_model(0, dtype=torch.bfloat16, arch=arch)
    pack_model(model, path, weights="q4_1")
    tokens = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        whole = model(tokens, model.new_cache(CacheConfig(max_len=16))).logits
        out = model(tokens, model.new_cache(CacheConfig(max_len=16)), features=(0, 2, 4))
        upto = model(tokens, model.new_cache(CacheConfig(max_len=16)), layers=[0, 1, 2], logits=LogitRows.NONE,
                     features=(2,)).features
        # adjacent cuts and a kept last layer, against the one-call-per-layer form (a cache that sees every write)
        kept = (0, 1, 3, 4)
        cut = model(tokens, model.new_cache(CacheConfig(max_len=16)), features=kept)
        per_layer = model(tokens, _Recorder(model.new_cache(CacheConfig(max_len=16))), features=kept)
    assert torch.equal(out.logits, whole)
    assert torch.equal(out.features[..., 64:128], upto)
    assert torch.equal(cut.logits, per_layer.logits) and torch.equal(cut.features, per_layer.features)


def _attention_layer(path: str, heads: int, kv_heads: int, head_dim: int, window: int) -> object:
    """The fused kernel's layer object of a one-layer model with this attention shape (``layer_attend`` reads only it)."""
    model = tiny_model(num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16,
                       hidden_size=64)
    model.layers[0].window = window or None
    pack_model(model, path, weights="bf16")
    return model.runner.layers[0]


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (12, 2, 128), (14, 2, 64), (8, 1, 32), (6, 2, 48)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_and_query_heads_that_attend_together_give_the_bits_of_each_alone(path, heads, kv_heads, head_dim, threads):
    """The fused layer attends the query heads of a key head and the rows of a sequence together (each key block read
    once for all of them), in pieces that depend on the rows and threads; each (row, head)'s output is bitwise what
    it gets attending alone (a one-head layer, one row over its own keys), for 1..17 rows, short and long contexts,
    a window and a token tree's key index."""
    from specdecode.models import native
    ops = native.kernel(path)
    layers_of = {w: (_attention_layer(path, heads, kv_heads, head_dim, w), _attention_layer(path, 1, 1, head_dim, w))
                 for w in (0, 37, 300)}
    g = torch.Generator().manual_seed(heads * head_dim)
    torch.set_num_threads(threads)
    try:
        # 300 keys: past a block of keys; a window of 300: each row's blocks start elsewhere than alone
        for length, n, window in [(1, 1, 0), (5, 2, 0), (300, 1, 0), (300, 4, 0), (700, 17, 0), (200, 3, 37),
                                  (700, 9, 300)]:
            layers = layers_of[window]
            keys = torch.randn(1, kv_heads, length, head_dim, generator=g).to(torch.bfloat16)
            values = torch.randn(1, kv_heads, length, head_dim, generator=g).to(torch.bfloat16)
            q = torch.randn(n, heads, head_dim, generator=g)
            trees = [(None, None)]
            if n > 1:  # row i sees the context and rows 0 and i of the new ones (a star-shaped tree)
                seen = [list(range(length - n + 1)) + ([length - n + i] if i else []) for i in range(n)]
                index = torch.tensor([s + [0] * (length - n + 2 - len(s)) for s in seen], dtype=torch.long)
                trees.append((index, torch.tensor([len(s) for s in seen], dtype=torch.long)))
            for index, counts in trees:
                together = torch.zeros(n, heads * head_dim)
                ops.layer_attend(layers[0], q, 0, n, keys, values, index, counts, together)
                for i in range(n):
                    end = length if index is not None else length - n + i + 1  # a tree's row reads its index
                    for h in range(heads):
                        kh = h // (heads // kv_heads)
                        one = torch.zeros(1, head_dim)
                        ops.layer_attend(layers[1], q[i:i + 1, h:h + 1].contiguous(), 0, 1,
                                         keys[:, kh:kh + 1, :end].contiguous(), values[:, kh:kh + 1, :end].contiguous(),
                                         None if index is None else index[i:i + 1],
                                         None if counts is None else counts[i:i + 1], one)
                        assert torch.equal(together[i, h * head_dim:(h + 1) * head_dim], one[0]), (length, n, i, h)
    finally:
        torch.set_num_threads(1)
