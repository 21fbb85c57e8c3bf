"""The linear kernels: ours (tiled, avx512, avx2: row-invariant, close to exact, exact speculation on
top of them), pre-packed oneDNN (bitwise F.linear in bf16 at every row count we run) and int8
weight-only. Each test of ours runs on every path this CPU can execute; the others skip with the reason."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import quantize as gguf_quantize
import torch
import torch.nn.functional as F
from torch import nn

from specdecode.drafters import DraftModelDrafter, LayerSkipDrafter, NgramDrafter
from specdecode.drafters.draft_model import draft_vocabulary
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.models import native
from specdecode.models.build import pack_model
from specdecode.models.linear import Int8Linear, NativeLinear, PackedLinear, QuantLinear, SplitLinear, can_pack
from specdecode.models.super_blocks import SUPER_FORMATS, SUPER_QTYPES, from_gguf
from specdecode.models.weights import BLOCK_FORMATS, BlockWeight, convert, quantize
from kernel_paths import NATIVE_PATHS, block_activations, path_params, path_problem
from tiny_gguf import k_quant_blocks
from tiny_models import varied_model

needs_onednn = pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="needs oneDNN bf16 on CPU")
OURS = path_params(NATIVE_PATHS)


@pytest.mark.parametrize("path", OURS)
@pytest.mark.parametrize("out_features,in_features,bias", [(5, 3, False), (160, 96, True), (130, 1537, True),
                                                           (576, 576, False)])
def test_ours_are_close_to_float64_and_row_invariant(path, out_features, in_features, bias):
    g = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g).to(torch.bfloat16) if bias else None
    layer = NativeLinear(weight, b, path)
    x = torch.randn(2, 16, in_features, generator=g).to(torch.bfloat16)  # [B, T, in]: 32 rows, several passes
    with torch.inference_mode():
        got = layer(x)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        assert got.shape == (2, 16, out_features) and got.dtype == torch.bfloat16
        # fp32 sums, then one rounding to bf16 (relative step 2^-8) of values about sqrt(in) in size.
        bound = exact.abs() * 2**-8 + in_features * 2**-20 * exact.abs().max()
        assert ((got.double() - exact).abs() <= bound).all()
        for rows in range(1, 33):  # every row bitwise the same whatever shares its call
            assert torch.equal(layer(x.view(32, in_features)[:rows]), got.view(32, out_features)[:rows]), rows
        assert torch.equal(layer(x[1:, 9:]), got[1:, 9:])


def test_the_widened_builds_agree_bitwise_and_with_a_sequential_fp32_sum():
    """avx512 and avx2 sum each output as one fp32 FMA chain in feature order: the same numbers on both."""
    runnable = [p for p in ("avx512", "avx2") if path_problem(p) is None]
    if not runnable:
        pytest.skip("neither widened build runs here: " + "; ".join(f"{p}: {path_problem(p)}" for p in ("avx512", "avx2")))
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(70, 9, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 9, generator=g).to(torch.bfloat16)
    outs = [NativeLinear(weight, None, p)(x) for p in runnable]
    w, xs = weight.float().numpy(), x.float().numpy()
    want = torch.empty(3, 70, dtype=torch.bfloat16)
    for m in range(3):
        for n in range(70):
            acc = np.float32(0)
            for k in range(9):  # bf16 x bf16 is exact in fp32, so this one rounding is what an FMA does
                acc = np.float32(acc + xs[m, k] * w[n, k])
            want[m, n] = float(acc)
    for out in outs:
        assert torch.equal(out, want)


STORED_ONLY = ("q5_0", "q5_1")  # read from GGUF blocks, never quantized to


def _blocks(weight: torch.Tensor, fmt: str) -> BlockWeight:
    """``weight`` in ``fmt``: our quantizer, or for q5_0/q5_1 llama.cpp's blocks (the gguf package's) read as stored."""
    if fmt not in STORED_ONLY:
        return quantize(weight, fmt)
    n, k = weight.shape
    padded = F.pad(weight, (0, -k % 32)).numpy()  # zero weights past k; x is zero there too
    qtype = {"q5_0": QT.Q5_0, "q5_1": QT.Q5_1}[fmt]
    stored = convert(gguf_quantize(padded, qtype), qtype, padded.shape, fmt)
    return BlockWeight(fmt, stored.codes, stored.d, stored.m, k)


@pytest.mark.parametrize("path", OURS)
@pytest.mark.parametrize("fmt", [*BLOCK_FORMATS, *STORED_ONLY])
@pytest.mark.parametrize("out_features,in_features,bias", [(5, 32, False), (160, 96, True), (70, 100, True),
                                                           (576, 1536, False)])
def test_block_formats_are_close_to_float64_and_row_invariant(path, fmt, out_features, in_features, bias):
    g = torch.Generator().manual_seed(out_features)
    blocks = _blocks(torch.randn(out_features, in_features, generator=g) * 0.1, fmt)
    b = torch.randn(out_features, generator=g) if bias else None
    layer = QuantLinear(blocks, b, path)
    x = torch.randn(70, in_features, generator=g)  # past 64 rows: the passes compiled without the next tile's prefetch
    with torch.inference_mode():
        got = layer(x)
        xq, w = block_activations(x), blocks.dequantize().double()
        exact = xq @ w.T + (0 if b is None else b.double())
        # Exact integer block sums, then fp32 scaling and one fp32 add per block (and the bias).
        bound = (in_features / 32 + 2) * 2**-23 * (xq.abs() @ w.abs().T + (0 if b is None else b.abs().double()))
        assert got.dtype == torch.float32 and ((got.double() - exact).abs() <= bound + 1e-30).all()
        for rows in [*range(1, 33), 64, 65]:  # every row bitwise the same whatever shares its call
            assert torch.equal(layer(x[:rows]), got[:rows]), rows
        assert torch.equal(layer(x.bfloat16()), layer(x.bfloat16().float()).bfloat16())  # bf16 in, bf16 out


@pytest.mark.parametrize("path", OURS)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q6_k"])
def test_a_block_too_small_for_its_scale_quantizes_to_zero_codes(path, fmt):
    """amax / 127 below 2^-128 makes 1 / d overflow: such a block counts as zeros (before, its codes were
    INT_MIN narrowed differently per build, and its code sums overflowed)."""
    g = torch.Generator().manual_seed(5)
    blocks = _stored_k_quant(fmt, 40, 256) if fmt in SUPER_FORMATS else _blocks(torch.randn(40, 256, generator=g), fmt)
    layer = QuantLinear(blocks, None, path)
    zero = torch.zeros(4, 256)
    zero[0] = torch.randn(256, generator=g)
    zero[3, :128] = torch.randn(128, generator=g)
    tiny = zero.clone()
    tiny[1, 32:64] = torch.linspace(-1e-37, 1e-37, 32)  # d ~ 8e-40: subnormal, 1 / d = inf
    tiny[2, 224:] = 1e-44
    tiny[3, 128:160] = 1e-38
    with torch.inference_mode():
        got = layer(tiny)
        assert torch.equal(got, layer(zero)) and not got[1:3].any()  # the tiny rows' only block: exactly zero
        assert torch.equal(block_activations(tiny), block_activations(zero))


def _stored_k_quant(fmt: str, n: int, k: int, seed: int = 0):
    return from_gguf(k_quant_blocks(SUPER_QTYPES[fmt], (n, k), seed), SUPER_QTYPES[fmt], (n, k))


@pytest.mark.parametrize("path", OURS)
def test_the_next_tile_prefetched_into_l1_or_l2_gives_the_same_bits(path):
    """Each CPU's choice (L1 where its L1 data cache holds 48 KB or more, linear_quant.h) and the other."""
    ops, layer = native.kernel(path), QuantLinear(_stored_k_quant("q4_k", 100, 512, seed=2), None, path)
    l1_bytes = ctypes.CDLL(None).sysconf(188)  # glibc's _SC_LEVEL1_DCACHE_SIZE (0 or -1 where unknown: L1)
    assert ops.prefetch_level() == (1 if 0 < l1_bytes < 48 * 1024 else 0)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(2))  # 9 rows: passes that prefetch in turns
    start, outs = ops.prefetch_level(), []
    try:
        for level in (0, 1):
            native.set_prefetch_level(level)
            assert ops.prefetch_level() == level
            outs.append(layer(x))
    finally:
        native.set_prefetch_level(start)
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match=r"must be 0 \(L1\) or 1 \(L2\), not 2"):
        native.set_prefetch_level(2)


@pytest.mark.parametrize("path", OURS)
def test_a_split_projection_computes_each_part_as_it_is_alone(path):
    """A GGUF's q and k in Q4_K beside v in Q6_K (and a q8_0 part): the parts' outputs in order, bitwise, through
    the layer and through the fused layer's one Proj of parts; widths off the tile size put parts mid-tile."""
    g = torch.Generator().manual_seed(3)
    weights = [_stored_k_quant("q4_k", 48, 512), _stored_k_quant("q6_k", 20, 512, seed=1),
               quantize(torch.randn(40, 512, generator=g), "q8_0")]
    parts = [QuantLinear(w, torch.randn(w.shape[0], generator=g), path) for w in weights]
    split = SplitLinear(parts)
    x = torch.randn(9, 512, generator=g)
    with torch.inference_mode():
        want = torch.cat([part(x) for part in parts], dim=-1)
        assert split.out_features == 108
        assert torch.equal(native.kernel(path).project_rows(split.proj(), x), want)
        for rows in (1, 4, 9):  # rows stay bitwise what they are alone
            assert torch.equal(native.kernel(path).project_rows(split.proj(), x[:rows]), want[:rows])
    bf16 = NativeLinear(torch.randn(16, 512, dtype=torch.bfloat16), None, path)
    with pytest.raises(RuntimeError, match="a projection's parts must be block formats over the same 512 inputs"):
        native.kernel(path).Proj([parts[0].proj(), bf16.proj()])
    with pytest.raises(ValueError, match="read the same inputs"):
        SplitLinear([parts[0], QuantLinear(_stored_k_quant("q4_k", 16, 256), None, path)])


@pytest.mark.parametrize("path", OURS)
@pytest.mark.parametrize("fmt", SUPER_FORMATS)
@pytest.mark.parametrize("out_features,in_features,bias", [(5, 256, False), (70, 512, True), (576, 1536, False)])
def test_k_quants_as_stored_are_close_to_float64_and_row_invariant(path, fmt, out_features, in_features, bias):
    g = torch.Generator().manual_seed(out_features)
    blocks = _stored_k_quant(fmt, out_features, in_features, seed=out_features)
    b = torch.randn(out_features, generator=g) if bias else None
    layer = QuantLinear(blocks, b, path)
    x = torch.randn(70, in_features, generator=g)  # past 64 rows: the passes compiled without the next tile's prefetch
    with torch.inference_mode():
        got = layer(x)
        xq, w = block_activations(x), blocks.dequantize().double()  # the file's own values, as gguf reads them
        exact = xq @ w.T + (0 if b is None else b.double())
        # Exact integer sums per block of 32 (q6_k: its two scaled halves), fp32 scaling, one fp32 add per block.
        bound = (in_features / 32 + 3) * 2**-23 * (xq.abs() @ w.abs().T + (0 if b is None else b.abs().double()))
        assert got.dtype == torch.float32 and ((got.double() - exact).abs() <= bound + 1e-30).all()
        for rows in [*range(1, 33), 64, 65]:  # every row bitwise the same whatever shares its call
            assert torch.equal(layer(x[:rows]), got[:rows]), rows
        assert torch.equal(layer(x.bfloat16()), layer(x.bfloat16().float()).bfloat16())  # bf16 in, bf16 out
        with pytest.raises(RuntimeError, match="multiple of 256"):
            layer(x[:, :in_features - 32])


@pytest.mark.parametrize("fmt", [*BLOCK_FORMATS, *STORED_ONLY, *SUPER_FORMATS])
def test_rows_read_from_their_tiles_equal_the_whole_weights_rows(fmt):
    runnable = [p for p in NATIVE_PATHS if path_problem(p) is None]
    if not runnable:
        pytest.skip("none of our kernels runs here")
    g = torch.Generator().manual_seed(4)
    blocks = _stored_k_quant(fmt, 70, 512) if fmt in SUPER_FORMATS else _blocks(torch.randn(70, 96, generator=g), fmt)
    layer = QuantLinear(blocks, None, runnable[0])
    rows = torch.tensor([69, 0, 33, 34, 5, 69])  # out of order, repeated, the last (padded) tile's
    assert torch.equal(layer.weight_rows(rows), blocks.rows(rows).dequantize())
    assert torch.equal(layer.weight_rows(rows), layer.blocks().rows(rows).dequantize())


@pytest.mark.parametrize("fmt", [*BLOCK_FORMATS, *STORED_ONLY, *SUPER_FORMATS])
def test_the_block_kernels_of_every_build_agree_bitwise(fmt):
    """Integer block sums (VNNI or AVX2's vpmaddubsw) and the same fp32 steps: one answer on every build."""
    runnable = [p for p in NATIVE_PATHS if path_problem(p) is None]
    if len(runnable) < 2:
        pytest.skip(f"fewer than two builds run here: {runnable}")
    g = torch.Generator().manual_seed(3)
    blocks = _stored_k_quant(fmt, 100, 512) if fmt in SUPER_FORMATS else _blocks(torch.randn(100, 320, generator=g), fmt)
    x = torch.randn(9, blocks.shape[1], generator=g) * 5
    outs = [QuantLinear(blocks, None, p)(x) for p in runnable]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("path", OURS)
@pytest.mark.parametrize("kind", ["ngram", "layerskip", "draft", "draft-vocab"])
@pytest.mark.parametrize("weights", ["bf16", *BLOCK_FORMATS, "q4_1+head", "q4_0+head"])
def test_greedy_speculation_is_exact_on_our_kernels(path, kind, weights):
    """``draft-vocab``: the draft model over half its ids and the request's (its head rows read from the packed
    tiles); the second prompt has a third of its tokens outside them, so it drafts over every id."""
    target = varied_model(0, dtype=torch.bfloat16)
    assert pack_model(target, path, weights=weights).name == path and pack_model(target).name == path  # idempotent
    formats = {"bf16": "bf16", "q8_0": "q8_0", "q4_1+head": "q4_1", "q4_0+head": "q4_0"}
    assert target.weight_format == formats.get(weights, f"{weights}, head q8_0")
    draft = varied_model(0, keep_layers=[0, 1], dtype=torch.bfloat16)
    pack_model(draft, path, weights=weights)
    drafter = {"ngram": lambda: NgramDrafter(max_ngram=3, min_ngram=1),
               "layerskip": lambda: LayerSkipDrafter(target, [1]), "draft": lambda: DraftModelDrafter(draft),
               "draft-vocab": lambda: DraftModelDrafter(draft, vocab=draft_vocabulary(draft, 48))}[kind]()
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


@pytest.mark.parametrize("path", OURS)
def test_plain_decoding_on_our_kernels_runs_one_row_per_step(path):
    target = varied_model(0, dtype=torch.bfloat16)
    pack_model(target, path)
    rows: list[int] = []
    forward_rows = target.forward_rows

    def spy(tokens, *args, **kwargs):  # every forward of the engine goes through forward_rows on our kernels
        rows.append(tokens.shape[0])
        return forward_rows(tokens, *args, **kwargs)
    target.forward_rows = spy
    engine = Engine(target)
    engine.warmup()  # no row padding is tuned under our kernels
    rows.clear()
    result = engine.generate([7, 8, 9, 10], max_new_tokens=6)
    # The prompt in one forward (its last row gives the first token), then one row per step, no filler, no
    # padding; the forwards after the steps time a plain step at the context the request ended at.
    assert rows[:6] == [4] + [1] * 5 and result.stats.target_forwards == 6 and set(rows[6:]) <= {1}


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
