"""The linear kernels: tiled (ours; row-invariant, close to F.linear, exact speculation on top of it),
pre-packed oneDNN (bitwise F.linear in bf16 at every row count we run) and int8 weight-only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdecode.drafters import DraftModelDrafter, LayerSkipDrafter, NgramDrafter
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.kv.cache import CacheConfig
from specdecode.models import tiled
from specdecode.models.linear import Int8Linear, PackedLinear, TiledLinear, can_pack
from specdecode.models.transformer import Transformer
from tiny_models import random_hf_tensors, tiny_config, tiny_model, varied_model

needs_onednn = pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="needs oneDNN bf16 on CPU")
needs_tiled = pytest.mark.skipif(tiled.kernel() is None, reason=f"tiled kernel unavailable: {tiled.unavailable_reason()}")


@needs_tiled
@pytest.mark.parametrize("out_features,in_features,bias", [(5, 3, False), (160, 96, True), (130, 1537, True)])
def test_tiled_is_close_to_float64_and_row_invariant(out_features, in_features, bias):
    g = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g).to(torch.bfloat16) if bias else None
    layer = TiledLinear(weight, b)
    x = torch.randn(2, 10, in_features, generator=g).to(torch.bfloat16)  # [B, T, in]: 20 rows, 4 passes of 6
    with torch.inference_mode():
        got = layer(x)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        assert got.shape == (2, 10, out_features) and got.dtype == torch.bfloat16
        # fp32 sums, then one rounding to bf16 (relative step 2^-8) of values about sqrt(in) in size.
        bound = exact.abs() * 2**-8 + in_features * 2**-20 * exact.abs().max()
        assert ((got.double() - exact).abs() <= bound).all()
        for rows in (1, 2, 5, 6, 7, 13):  # every row bitwise the same whatever shares its call
            assert torch.equal(layer(x.view(20, in_features)[:rows]), got.view(20, out_features)[:rows])
        assert torch.equal(layer(x[1:, 9:]), got[1:, 9:])


@needs_tiled
@pytest.mark.parametrize("kind", ["ngram", "layerskip", "draft"])
def test_greedy_speculation_is_exact_on_the_tiled_kernel(kind):
    target = varied_model(0, dtype=torch.bfloat16)
    assert target.pack_weights("tiled") == "tiled" and target.pack_weights() == "tiled"  # idempotent
    draft = varied_model(0, keep_layers=[0, 1], dtype=torch.bfloat16)
    draft.pack_weights("tiled")
    drafter = {"ngram": NgramDrafter(max_ngram=3, min_ngram=1), "layerskip": LayerSkipDrafter(target, [1]),
               "draft": DraftModelDrafter(draft)}[kind]
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9], [90, 3, 17, 44, 2, 60]]
    plain = [Engine(target).generate(p, max_new_tokens=24).token_ids for p in prompts]
    drafted = accepted = 0
    for gamma in (2, 7):  # verifications of 3 and 8 rows (one and two passes of the kernel)
        engine = Engine(target, drafter=drafter, spec=SpeculativeConfig(gamma=gamma))
        for prompt, want in zip(prompts, plain):
            result = engine.generate(prompt, max_new_tokens=24)
            assert result.token_ids == want, (kind, gamma, prompt)
            drafted += result.stats.drafted_tokens
            accepted += result.stats.accepted_tokens
    assert drafted > accepted  # rejections were rolled back ...
    assert accepted > 0 or kind == "ngram"  # ... and acceptances kept (the bf16 model does not loop)


@needs_tiled
def test_plain_decoding_on_the_tiled_kernel_runs_one_row_per_step():
    target = varied_model(0, dtype=torch.bfloat16)
    target.pack_weights("tiled")
    rows: list[int] = []
    target.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[1]))
    engine = Engine(target)
    engine.warmup()  # no row padding is tuned under the tiled kernel
    rows.clear()
    engine.generate([7, 8, 9, 10], max_new_tokens=6)
    assert rows == [3] + [1] * 6  # prefill of all but the last token, then one row per step (no filler, no padding)


@needs_tiled
def test_pack_weights_names_what_is_wrong():
    model = varied_model(0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'fast' is not one of auto, tiled, onednn, torch"):
        model.pack_weights("fast")
    assert model.pack_weights("torch") == "torch" and model.linear_kernel == "torch"
    assert model.pack_weights("tiled") == "tiled"
    with pytest.raises(ValueError, match="already run on tiled; cannot switch to onednn"):
        model.pack_weights("onednn")
    with pytest.raises(ValueError, match="needs a bf16 model on the CPU .*float32"):
        tiny_model("llama").pack_weights("tiled")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear_bitwise(rows, bias):
    g = torch.Generator().manual_seed(rows)
    layer = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(1, rows, 96, generator=g).to(torch.bfloat16)  # [B, T, in]
    packed = PackedLinear(layer.weight, layer.bias)
    with torch.inference_mode():
        got = packed(x)
        assert got.shape == (1, rows, 160)
        assert torch.equal(got, F.linear(x, layer.weight, layer.bias))


@needs_onednn
def test_packing_refuses_float32_and_reports_bytes():
    with pytest.raises(ValueError, match="cannot pack a torch.float32 weight"):
        PackedLinear(torch.zeros(4, 4))
    packed = PackedLinear(torch.zeros(8, 4, dtype=torch.bfloat16))
    assert packed.nbytes == 8 * 4 * 2 and "packed" in repr(packed)


def test_int8_weights_within_half_a_step_and_output_close():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 48, generator=g)
    layer = Int8Linear(weight, torch.randn(64, generator=g), dtype=torch.float32)
    step = weight.abs().amax(dim=1, keepdim=True) / 127  # one quantization step per output row
    assert ((layer.dequantized() - weight).abs() <= step / 2 + 1e-7).all()
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() == 127
    x = torch.randn(3, 48, generator=g)
    exact = x @ layer.dequantized().T + layer.bias
    torch.testing.assert_close(layer(x), exact, atol=1e-4, rtol=1e-4)  # the kernel computes with s * Q
    assert not torch.allclose(layer(x), x @ weight.T + layer.bias, atol=1e-5)  # ... which is not the float weight


def test_int8_model_halves_projection_bytes_and_stays_close():
    config = tiny_config("llama", tie_word_embeddings=True, hidden_size=64, intermediate_size=128)
    tensors = random_hf_tensors(config, seed=2, scale=0.2)
    plain = Transformer.from_hf_tensors(config, tensors, dtype=torch.bfloat16)
    quant = Transformer.from_hf_tensors(config, tensors, dtype=torch.bfloat16)
    quant.quantize_weights()
    assert quant.weight_nbytes < plain.weight_nbytes * 0.75
    assert quant.pack_weights() == quant.linear_kernel == "int8"
    with pytest.raises(ValueError, match="already packed or quantized"):
        quant.quantize_weights()
    ids = torch.randint(0, config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = plain(ids, plain.new_cache(CacheConfig(max_len=16)))
        got = quant(ids, quant.new_cache(CacheConfig(max_len=16)))
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
