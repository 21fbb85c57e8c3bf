"""CompressedCache without a model: exact views (sinks + window + quantized middle + tail), rollback across a
quantization flush and after the window wrapped, stable_rows, memory accounting, errors."""

from __future__ import annotations

import random

import pytest
import torch

from specdecode.kv.cache import CacheConfig, CacheFullError, KVCache
from specdecode.kv.compressed import CompressedCache
from specdecode.kv.factory import make_cache
from specdecode.kv.quant import dequantize, quantize
from specdecode.models.rows import LogitRows
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, HEADS, DIM = 2, 2, 8


def _raw(n: int, seed: int) -> torch.Tensor:
    """Keys (or values) of ``n`` positions for every layer: ``[LAYERS, HEADS, n, DIM]``."""
    return torch.randn(LAYERS, HEADS, n, DIM, generator=torch.Generator().manual_seed(seed))


def _cache(**kw) -> CompressedCache:
    kw.setdefault("max_len", 512)
    kw.setdefault("prefill_chunk", min(64, kw.get("lookahead", 80)))
    return CompressedCache(LAYERS, HEADS, DIM, CacheConfig(**kw))


def _write(cache, keys: torch.Tensor, values: torch.Tensor, start: int, slot: int = 0) -> list:
    """One forward writing positions ``start..`` of every layer; returns each layer's (keys, values)."""
    out = [cache.update(layer, [slot], [start], keys[layer][None], values[layer][None]) for layer in range(LAYERS)]
    cache.advance([slot], keys.shape[2])
    return out


def _spec(config: CacheConfig, x: int) -> tuple[int, int]:
    """(e, F) as the module docstring states them: at least `window` verified tokens after e, moved in chunks;
    at least `residual` verified tokens after F, moved a group at a time; both relative to the sinks."""
    s = config.sinks
    e = s
    if config.window is not None:
        chunk = config.group_size if config.bits else config.evict_chunk
        while x - (e + chunk) >= config.window:
            e += chunk
    f = e
    if config.bits:
        f = s
        while x - (f + config.group_size) >= config.residual:
            f += config.group_size
        f = max(f, e)
    return e, f


def _expected(config: CacheConfig, k: torch.Tensor, p: int, t: int, committed: int) -> torch.Tensor:
    """What one layer's update at position p with t new tokens must return, from the raw keys ``[H, n, D]``."""
    if p < config.sinks:
        return k[:, :p + t]
    e, f = _spec(config, min(committed, p))
    parts = [k[:, :config.sinks]]
    if f > e:
        g = config.group_size
        groups = k[:, e:f].reshape(HEADS, (f - e) // g, g, DIM)
        parts.append(dequantize(*quantize(groups, config.bits, dim=2), config.bits, k.dtype).reshape(HEADS, f - e, DIM))
    parts.append(k[:, f:p + t])
    return torch.cat(parts, dim=1)


def _expected_values(config: CacheConfig, v: torch.Tensor, p: int, t: int, committed: int) -> torch.Tensor:
    if p < config.sinks:
        return v[:, :p + t]
    e, f = _spec(config, min(committed, p))
    parts = [v[:, :config.sinks]]
    if f > e:
        parts.append(dequantize(*quantize(v[:, e:f], config.bits, dim=-1), config.bits, v.dtype))
    parts.append(v[:, f:p + t])
    return torch.cat(parts, dim=1)


SETTINGS = {
    "window": dict(window=8, sinks=2, evict_chunk=3),
    "window-no-sinks": dict(window=5, evict_chunk=1),
    "int8": dict(kv_dtype="int8", group_size=4, residual=4),
    "int4": dict(kv_dtype="int4", group_size=4, residual=0),
    "int8-window": dict(kv_dtype="int8", window=12, sinks=1, group_size=4, residual=4),
    "int4-window": dict(kv_dtype="int4", window=5, sinks=3, group_size=2, residual=3),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_speculative_decoding_pattern_gives_exact_views(name):
    """Draft steps (1 + k tokens), rejections with junk, trims, commits, for 150 positions: every update
    returns exactly the spec's entries, built from the accepted keys only."""
    cache = _cache(**SETTINGS[name], lookahead=16)
    config = cache.config
    keys, values, junk = _raw(200, 0), _raw(200, 1), _raw(200, 2)
    rng = random.Random(0)
    prompt = 7
    cache.commit(0, prompt)
    _write(cache, keys[:, :, :prompt], values[:, :, :prompt], 0)
    p = prompt
    flushed_seen = evicted_seen = False
    while p < 150:
        k = rng.randint(0, 6)
        a = rng.randint(0, k)
        # Row 0 is the fed token (real), then a accepted drafts (real), then rejected ones (junk).
        rows_k = torch.cat([keys[:, :, p:p + 1 + a], junk[:, :, p + 1 + a:p + 1 + k]], dim=2)
        rows_v = torch.cat([values[:, :, p:p + 1 + a], junk[:, :, p + 1 + a:p + 1 + k]], dim=2)
        visible = cache.visible(0)
        out = _write(cache, rows_k, rows_v, p)
        for layer, (got_k, got_v) in enumerate(out):
            want_k = _expected(config, torch.cat([keys[layer, :, :p], rows_k[layer]], dim=1), p, 1 + k, cache.committed[0])
            want_v = _expected_values(config, torch.cat([values[layer, :, :p], rows_v[layer]], dim=1), p, 1 + k,
                                      cache.committed[0])
            assert torch.equal(got_k[0], want_k), (name, p, layer)
            assert torch.equal(got_v[0], want_v), (name, p, layer)
        assert out[0][0].shape[2] == visible + 1 + k
        cache.trim(0, p + 1 + a)
        cache.commit(0, p + 1 + a)
        p += 1 + a
        e, f = cache.evicted[0][0], cache.flushed[0][0]
        flushed_seen |= f > e
        evicted_seen |= e > config.sinks
    # The run really compressed (otherwise it proves nothing).
    assert flushed_seen == bool(config.bits)
    assert evicted_seen == (config.window is not None)


def test_rollback_across_a_quantization_flush():
    cache = _cache(kv_dtype="int8", group_size=4, residual=4)
    keys, values, junk = _raw(40, 0), _raw(40, 1), _raw(40, 2)
    cache.commit(0, 17)
    _write(cache, keys[:, :, :17], values[:, :, :17], 0)  # [0, 17) verified, nothing quantized yet
    assert cache.flushed[0][0] == 0
    # Unverified tokens 17..21 straddle the group boundary at 20; the write itself flushes up to F(17) = 12.
    _write(cache, junk[:, :, 17:22], junk[:, :, 17:22], 17)
    assert cache.flushed[0][0] == 12 and cache.lengths == [22]
    cache.trim(0, 18)  # keep 17, reject 18..21
    out = _write(cache, keys[:, :, 18:20], values[:, :, 18:20], 18)  # 17 was junk: rewrite it too
    cache.trim(0, 17)
    out = _write(cache, keys[:, :, 17:21], values[:, :, 17:21], 17)
    for layer, (got_k, got_v) in enumerate(out):
        assert torch.equal(got_k[0], _expected(cache.config, keys[layer, :, :21], 17, 4, 17))
        assert torch.equal(got_v[0], _expected_values(cache.config, values[layer, :, :21], 17, 4, 17))
    # The same stream written without any rejection gives the same view.
    clean = _cache(kv_dtype="int8", group_size=4, residual=4)
    clean.commit(0, 17)
    _write(clean, keys[:, :, :17], values[:, :, :17], 0)
    again = _write(clean, keys[:, :, 17:21], values[:, :, 17:21], 17)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(out, again))


def test_rolling_back_verified_tokens_only_while_they_are_uncompressed():
    cache = _cache(kv_dtype="int8", group_size=4, residual=4)
    keys = _raw(30, 0)
    cache.commit(0, 20)
    _write(cache, keys[:, :, :20], keys[:, :, :20], 0)
    _write(cache, keys[:, :, 20:21], keys[:, :, 20:21], 20)  # compacts to F(20) = 16
    assert cache.flushed[0][0] == 16
    cache.trim(0, 20)  # a sequence of 20 still has F = 16: fine
    assert cache.committed == [20] and cache.lengths == [20]
    with pytest.raises(ValueError, match=r"cannot trim slot 0 to 19: tokens up to position 16 are already quantized"):
        cache.trim(0, 19)
    window = _cache(window=4, sinks=1, evict_chunk=2)
    window.commit(0, 12)
    _write(window, keys[:, :, :12], keys[:, :, :12], 0)
    _write(window, keys[:, :, 12:13], keys[:, :, 12:13], 12)
    assert window.evicted[0][0] == 7
    with pytest.raises(ValueError, match="already evicted"):
        window.trim(0, 10)
    with pytest.raises(ValueError, match="cannot trim slot 0 of length 13 to 14"):
        window.trim(0, 14)


def test_rollback_after_the_window_wrapped_many_times():
    """Far past the window: unverified tokens written after wrap-around roll back to exactly the kept entries."""
    cache = _cache(window=6, sinks=2, evict_chunk=4, max_len=4096)
    keys, junk = _raw(1000, 0), _raw(1000, 1)
    cache.commit(0, 900)
    for start in range(0, 900, 50):  # a long prompt in chunks: evicts hundreds of times
        _write(cache, keys[:, :, start:start + 50], keys[:, :, start:start + 50], start)
    _write(cache, junk[:, :, 900:906], junk[:, :, 900:906], 900)  # drafts, all rejected
    cache.trim(0, 900)
    out = _write(cache, keys[:, :, 900:902], keys[:, :, 900:902], 900)
    e, _ = _spec(cache.config, 900)
    want = torch.cat([keys[0, :, :2], keys[0, :, e:902]], dim=1)
    assert torch.equal(out[0][0][0], want)
    assert 6 <= 900 - e < 6 + 4


def test_window_memory_is_flat_however_long_the_sequence():
    config = dict(window=16, sinks=4, evict_chunk=8, lookahead=8)
    short, long = _cache(max_len=64, **config), _cache(max_len=100_000, **config)
    assert short.nbytes == long.nbytes
    keys = _raw(3000, 0)
    used = []
    for p in range(0, 3000, 4):
        long.commit(0, p + 4)
        _write(long, keys[:, :, p:p + 4], keys[:, :, p:p + 4], p)
        used.append(long.bytes_used(0))
    per_token = long.bytes_per_token
    assert max(used) <= (4 + 16 + 8 + 4) * per_token
    assert max(used[-100:]) == max(used[100:200])  # steady state


@pytest.mark.parametrize("name", ["int8", "window", "int8-window"])
def test_stable_rows_is_the_distance_to_the_next_compression_step(name):
    cache = _cache(**SETTINGS[name])
    config = cache.config
    for p in range(0, 60):
        cache.lengths[0] = cache.committed[0] = p
        want = next(d for d in range(1, 100) if _spec(config, p + d) != _spec(config, p))
        assert cache.stable_rows(0) == want, p


def test_a_forward_straddling_a_step_shows_later_rows_another_cache_than_one_token_decoding():
    """Why the engine stops a draft at stable_rows: past the step, a row of one big forward sees its
    older tokens unquantized, while decoding it alone (after the step) sees them quantized."""
    config = dict(kv_dtype="int4", group_size=4, residual=4)
    keys = _raw(40, 0)
    big, single = _cache(**config), _cache(**config)
    for cache in (big, single):
        cache.commit(0, 10)
        _write(cache, keys[:, :, :10], keys[:, :, :10], 0)
    assert big.stable_rows(0) == 2  # F moves from 4 to 8 when 12 tokens are verified
    rows = _write(big, keys[:, :, 10:15], keys[:, :, 10:15], 10)[0][0][0]  # [H, 15, D]
    for q in range(10, 15):  # decode the same tokens one per forward, verified as they come
        single.commit(0, q)
        alone = _write(single, keys[:, :, q:q + 1], keys[:, :, q:q + 1], q)[0][0][0]
        seen_by_big_row = rows[:, :q + 1]
        if q - 10 < 2:
            assert torch.equal(alone, seen_by_big_row)
        else:
            assert not torch.equal(alone, seen_by_big_row)


def test_batch_rows_are_padded_and_each_equals_its_single_slot_update():
    config = CacheConfig(max_len=64, slots=2, kv_dtype="int8", window=8, sinks=1, group_size=2, residual=2)
    batch = CompressedCache(LAYERS, HEADS, DIM, config)
    keys = _raw(40, 0)
    singles = []
    for slot, n in ((0, 30), (1, 9)):
        single = CompressedCache(LAYERS, HEADS, DIM, config)
        for cache in (batch, single):
            cache.commit(slot, n)
            _write(cache, keys[:, :, :n], keys[:, :, :n], 0, slot=slot)
        singles.append(single)
    new = keys[:, :, 30:32]
    got = batch.update(0, [1, 0], [9, 30], torch.stack([new[0], new[0]]), torch.stack([new[0], new[0]]))
    want = [singles[1].update(0, [1], [9], new[0][None], new[0][None]),
            singles[0].update(0, [0], [30], new[0][None], new[0][None])]
    width = max(w[0].shape[2] for w in want)
    assert got[0].shape == (2, HEADS, width, DIM)
    for row, (wk, wv) in enumerate(want):
        n = wk.shape[2]
        assert torch.equal(got[0][row, :, :n], wk[0]) and torch.equal(got[1][row, :, :n], wv[0])
        assert not got[0][row, :, n:].any()
    assert [batch.visible(1) + 2, batch.visible(0) + 2] == [w[0].shape[2] for w in want]


def test_float_window_cache_returns_the_models_dtype_and_a_view_of_its_buffer():
    cache = _cache(kv_dtype="bfloat16", window=8)
    keys = _raw(4, 0)
    k, v = cache.update(0, [0], [0], keys[0][None], keys[0][None])
    assert cache.fp_k[0].dtype == torch.bfloat16 and k.dtype == torch.float32
    assert torch.equal(k[0], keys[0].bfloat16().float())
    same = _cache(window=8)
    k, _ = same.update(0, [0], [0], keys[0][None], keys[0][None])
    assert k.untyped_storage().data_ptr() == same.fp_k[0].untyped_storage().data_ptr()


def test_unverified_tokens_beyond_the_lookahead_are_refused_with_a_clear_error():
    cache = _cache(kv_dtype="int8", group_size=4, residual=4, lookahead=8)
    keys = _raw(30, 0)
    # Room: residual + group - 1 verified tokens that may not be quantized yet, plus the lookahead.
    _write(cache, keys[:, :, :15], keys[:, :, :15], 0)  # nothing committed: all in full precision
    with pytest.raises(CacheFullError, match=r"writing 1 tokens at position 15 \(verified up to 0\).*room for 16 "
                                             r"recent tokens, it has 15 \(lookahead 8\); commit verified"):
        _write(cache, keys[:, :, 15:16], keys[:, :, 15:16], 15)
    cache.commit(0, 15)
    _write(cache, keys[:, :, 15:23], keys[:, :, 15:23], 15)  # fine once they are verified
    small = _cache(window=4, max_len=10)
    with pytest.raises(CacheFullError, match="holds 10 tokens per sequence; a write up to 11"):
        small.commit(0, 11)
        _write(small, keys[:, :, :11], keys[:, :, :11], 0)
    with pytest.raises(ValueError, match="appends at the slot's length 23, not at 3"):
        cache.update(0, [0], [3], keys[0][None, :, :1], keys[0][None, :, :1])


def test_int4_needs_an_even_head_dim_and_plain_settings_are_not_compressed():
    with pytest.raises(ValueError, match="must be even, got 7"):
        CompressedCache(1, 1, 7, CacheConfig(kv_dtype="int4"))
    with pytest.raises(ValueError, match="use KVCache"):
        CompressedCache(1, 1, 8, CacheConfig(kv_dtype="bfloat16"))
    assert isinstance(make_cache(1, 1, 8, CacheConfig(kv_dtype="bfloat16"), torch.float32), KVCache)
    assert isinstance(make_cache(1, 1, 8, CacheConfig(window=3), torch.float32), CompressedCache)


# --------------------------------------------------------------------------- memory accounting


@pytest.mark.parametrize("kv_dtype, bits", [("int8", 8), ("int4", 4)])
def test_quantized_bytes_per_token_count_codes_scales_and_zero_points(kv_dtype, bits):
    g = 4
    cache = _cache(kv_dtype=kv_dtype, group_size=g, residual=4)
    codes = 2 * HEADS * DIM * bits // 8  # keys + values
    scales = 2 * 4 * (HEADS * DIM / g + HEADS)  # float32 scale + zero: keys per group and channel, values per token
    assert cache.bytes_per_token == pytest.approx(LAYERS * (codes + scales))
    assert cache.bytes_per_token < _cache(window=8).bytes_per_token  # vs full precision (fp32 here)
    meta = make_cache(LAYERS, HEADS, DIM, cache.config, torch.float32, device="meta")
    assert meta.nbytes == cache.nbytes == sum(t.numel() * t.element_size() for t in
                                              cache.fp_k + cache.fp_v + cache.k_codes + cache.v_codes + cache.k_scale +
                                              cache.k_zero + cache.v_scale + cache.v_zero)
    keys = _raw(100, 0)
    cache.commit(0, 100)
    for p in range(0, 100, 10):
        _write(cache, keys[:, :, p:p + 10], keys[:, :, p:p + 10], p)
    cache.update(0, [0], [100], keys[0][None, :, :1], keys[0][None, :, :1])  # compacts layer 0 only
    fp_token = 2 * HEADS * DIM * 4
    e0, f0 = cache.evicted[0][0], cache.flushed[0][0]
    e1, f1 = cache.evicted[1][0], cache.flushed[1][0]
    assert (f0, f1) == (96, 84)  # layer 1 was last written at 90; it compacts when next written
    want = (100 - f0) * fp_token + (f0 - e0) * (codes + scales)
    want += (100 - f1) * fp_token + (f1 - e1) * (codes + scales)
    assert cache.bytes_used(0) == round(want)
    assert cache.bytes_used() == cache.bytes_used(0)


# --------------------------------------------------------------------------- with a model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _decode(model, config: CacheConfig, ids: list[int], prompt: int) -> torch.Tensor:
    """Prefill ``prompt`` tokens, then decode the rest one token at a time (committing as it goes)."""
    cache = model.new_cache(config)
    cache.commit(0, prompt)
    model(torch.tensor([ids[:prompt]]), cache, logits=LogitRows.NONE)
    out = []
    for i in range(prompt, len(ids)):
        cache.commit(0, i)
        out.append(model(torch.tensor([[ids[i]]]), cache).logits[0, -1])
    return torch.stack(out)


def test_model_over_a_compressed_cache():
    model = tiny_model("llama")
    ids = [(7 * i + 3) % 97 for i in range(60)]
    plain = _decode(model, CacheConfig(max_len=64), ids, 20)
    # Nothing compressed yet: bitwise the plain cache's numbers.
    assert torch.equal(_decode(model, CacheConfig(max_len=64, window=60), ids, 20), plain)
    assert torch.equal(_decode(model, CacheConfig(max_len=64, kv_dtype="int8", residual=60), ids, 20), plain)
    # Quantized: close, int8 closer than int4; a small window: further still.
    err = {}
    for name, config in {"int8": CacheConfig(max_len=64, kv_dtype="int8", group_size=8, residual=8),
                         "int4": CacheConfig(max_len=64, kv_dtype="int4", group_size=8, residual=8),
                         "window": CacheConfig(max_len=64, window=8, sinks=2, evict_chunk=4)}.items():
        err[name] = (_decode(model, config, ids, 20) - plain).abs().max().item()
    assert 0 < err["int8"] < err["int4"] < 0.5
    assert err["window"] > err["int8"]


def test_mistral_sliding_window_over_a_window_cache_sees_the_same_keys_as_over_a_plain_cache():
    """The model's own window counts returned entries; a cache window of at least that many recent tokens
    therefore leaves Mistral's attention exactly as it is over a plain cache."""
    model = tiny_model("mistral", sliding_window=6, tie_word_embeddings=False, attention_bias=False)
    ids = [(5 * i + 1) % 97 for i in range(50)]
    plain = _decode(model, CacheConfig(max_len=64), ids, 20)
    windowed = _decode(model, CacheConfig(max_len=64, window=8, sinks=3, evict_chunk=4), ids, 20)
    assert torch.equal(windowed, plain)
    too_small = _decode(model, CacheConfig(max_len=64, window=3, evict_chunk=1), ids, 20)
    assert not torch.equal(too_small, plain)


@pytest.mark.parametrize("config", [dict(window=6, sinks=2, evict_chunk=2), dict(kv_dtype="int8", group_size=4, residual=2)],
                         ids=["window", "int8"])
def test_a_batch_of_two_slots_over_a_compressed_cache_equals_the_single_slot_path(config):
    """Rows hold different numbers of entries; the model masks each row by its own visible count."""
    model = tiny_model("llama")
    seqs, new = ([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [27, 18, 28]), ([50, 51, 52], [60, 61, 62])
    batch = model.new_cache(CacheConfig(max_len=32, slots=2, **config))
    for slot, seq in enumerate(seqs):
        batch.commit(slot, len(seq))
        model(torch.tensor([seq]), batch, slots=(slot,), logits=LogitRows.NONE)
    got = model(torch.tensor(list(new)), batch, slots=(0, 1)).logits
    for row, (seq, tokens) in enumerate(zip(seqs, new)):
        single = model.new_cache(CacheConfig(max_len=32, **config))
        single.commit(0, len(seq))
        model(torch.tensor([seq]), single, logits=LogitRows.NONE)
        torch.testing.assert_close(got[row:row + 1], model(torch.tensor([tokens]), single).logits, atol=1e-4, rtol=0)
    assert batch.evicted[0][0] > 2 or batch.flushed[0][0] > 0  # slot 0 really dropped or quantized something
    assert (got[0] - got[1]).abs().max() > 1e-2
