"""CacheConfig and KVCache: writes by index, per-slot lengths, commits, rollback by trimming, memory accounting."""

from __future__ import annotations

import pytest
import torch

from specdecode.kv.cache import CacheConfig, CacheFullError, KVCache
from specdecode.models.rows import LogitRows
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, HEADS, DIM = 2, 3, 4


def _cache(max_len: int = 16, slots: int = 1, dtype: torch.dtype = torch.float32) -> KVCache:
    return KVCache(LAYERS, HEADS, DIM, CacheConfig(max_len=max_len, slots=slots), dtype=dtype)


def _kv(batch: int, t: int, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.arange(batch * HEADS * t * DIM, dtype=torch.float32).view(batch, HEADS, t, DIM) + 1 + offset
    return k, -k


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


# --------------------------------------------------------------------------- config and errors


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_len=0), r"CacheConfig\.max_len must be >= 1, got 0"),
    (dict(max_len=-5), r"CacheConfig\.max_len must be >= 1, got -5"),
    (dict(slots=0), r"CacheConfig\.slots must be >= 1, got 0"),
    (dict(kv_dtype="int2"), r"CacheConfig\.kv_dtype='int2': expected one of auto, bfloat16, float32, int8, int4"),
    (dict(window=0), r"CacheConfig\.window must be >= 1 \(or None for no window\), got 0"),
    (dict(sinks=-1, window=4), r"CacheConfig\.sinks must be >= 0, got -1"),
    (dict(sinks=4), r"CacheConfig\.sinks=4 needs a window"),
    (dict(budget=0), r"CacheConfig\.budget must be >= 1 byte \(or None for no limit\), got 0"),
    (dict(group_size=0), r"CacheConfig\.group_size must be >= 1, got 0"),
    (dict(residual=-1), r"CacheConfig\.residual must be >= 0, got -1"),
    (dict(evict_chunk=0), r"CacheConfig\.evict_chunk must be >= 1, got 0"),
    (dict(prefill_chunk=100, lookahead=80), r"CacheConfig\.prefill_chunk \(100\) must be <= lookahead \(80\)"),
    (dict(kv_dtype="int8", window=16, residual=32), r"CacheConfig\.window \(16\) must be >= residual \(32\)"),
])
def test_cache_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig(**kwargs)


def test_cache_config_defaults_are_valid():
    c = CacheConfig(max_len=1, slots=1)
    assert (c.max_len, c.slots) == (1, 1)
    assert not c.compressed and c.bits is None and c.budget is None and not c.prefix_cache
    assert CacheConfig(window=16, residual=32).window == 16  # the residual only matters when quantizing
    assert (CacheConfig(kv_dtype="int8").bits, CacheConfig(kv_dtype="int4").bits) == (8, 4)
    assert CacheConfig(kv_dtype="int4").compressed and CacheConfig(window=8).compressed
    assert not CacheConfig(kv_dtype="bfloat16").compressed


def test_default_lookahead_covers_the_longest_draft_step():
    from specdecode.control.config import MAX_GAMMA

    # One verification writes the fed token and up to MAX_GAMMA drafts; the filler row of a plain step fits too.
    assert CacheConfig().lookahead >= MAX_GAMMA + 2 and CacheConfig().prefill_chunk <= CacheConfig().lookahead


def test_layout_names_what_determines_the_cached_numbers():
    a = CacheConfig(max_len=10, kv_dtype="int8")
    assert a.layout == CacheConfig(max_len=99, budget=5, prefix_cache=True, kv_dtype="int8").layout
    assert a.layout != CacheConfig(kv_dtype="int4").layout != CacheConfig(window=8).layout


def test_cache_full_error_names_capacity_and_requested_end():
    cache = _cache(max_len=8)
    k, v = _kv(1, 3)
    cache.update(0, [0], [5], k, v)  # ends exactly at max_len: allowed
    with pytest.raises(CacheFullError, match=r"holds 8 tokens per sequence; a write up to 9 was asked"):
        cache.update(0, [0], [6], k, v)
    assert issubclass(CacheFullError, RuntimeError)


def test_cache_full_error_from_model_forward(model):
    cache = model.new_cache(CacheConfig(max_len=4))
    model(torch.tensor([[1, 2, 3]]), cache, logits=LogitRows.NONE)
    with pytest.raises(CacheFullError, match="a write up to 5"):
        model(torch.tensor([[4, 5]]), cache)


# --------------------------------------------------------------------------- update / lengths


def test_update_single_slot_writes_by_index_and_returns_prefix_view():
    cache = _cache(max_len=16, slots=2)
    k, v = _kv(1, 3)
    keys, values = cache.update(1, [1], [4], k, v)
    assert keys.shape == (1, HEADS, 7, DIM) and values.shape == (1, HEADS, 7, DIM)
    assert torch.equal(cache.k[1][1, :, 4:7], k[0]) and torch.equal(cache.v[1][1, :, 4:7], v[0])
    assert torch.equal(keys[0, :, 4:7], k[0]) and torch.equal(values[0, :, 4:7], v[0])
    # Untouched: other slot, other layer, positions outside the write.
    assert not cache.k[1][0].any() and not cache.k[0].any()
    assert not cache.k[1][1, :, :4].any() and not cache.k[1][1, :, 7:].any()
    # The single-slot path hands out a view of the buffer, not a copy.
    assert keys.untyped_storage().data_ptr() == cache.k[1].untyped_storage().data_ptr()
    # update() does not move lengths; advance() does.
    assert cache.lengths == [0, 0]


def test_update_batch_writes_each_row_at_its_start_and_returns_up_to_max_start_plus_t():
    cache = _cache(max_len=16, slots=3)
    k, v = _kv(2, 2)
    keys, values = cache.update(0, [2, 0], [5, 1], k, v)
    assert keys.shape == (2, HEADS, 7, DIM)  # max(5, 1) + 2
    assert torch.equal(cache.k[0][2, :, 5:7], k[0]) and torch.equal(cache.v[0][2, :, 5:7], v[0])
    assert torch.equal(cache.k[0][0, :, 1:3], k[1]) and torch.equal(cache.v[0][0, :, 1:3], v[1])
    # Rows come back in the order of `slots`.
    assert torch.equal(keys[0, :, 5:7], k[0]) and torch.equal(keys[1, :, 1:3], k[1])
    assert torch.equal(values[1, :, 1:3], v[1])
    assert not cache.k[0][1].any()  # slot 1 untouched
    assert not cache.k[0][0, :, 3:].any() and not cache.k[0][2, :, :5].any()


def test_advance_trim_reset():
    cache = _cache(max_len=16, slots=2)
    cache.advance([0, 1], 5)
    cache.advance([1], 3)
    assert cache.lengths == [5, 8]
    cache.trim(1, 6)
    assert cache.lengths == [5, 6]
    cache.trim(1, 6)  # same length is allowed
    cache.trim(0, 0)
    assert cache.lengths == [0, 6]
    cache.reset(1)
    assert cache.lengths == [0, 0]


@pytest.mark.parametrize("length", [6, -1])
def test_trim_outside_held_range_raises(length):
    cache = _cache()
    cache.advance([0], 5)
    with pytest.raises(ValueError, match=f"cannot trim slot 0 of length 5 to {length}"):
        cache.trim(0, length)
    assert cache.lengths == [5]


def test_trim_does_not_copy_or_clear_buffers():
    cache = _cache()
    k, v = _kv(1, 4)
    cache.update(0, [0], [0], k, v)
    cache.advance([0], 4)
    before = cache.k[0]
    cache.trim(0, 1)
    assert cache.k[0] is before
    assert torch.equal(cache.k[0][0, :, :4], k[0])  # stale entries stay until overwritten


def test_commit_visible_and_stable_rows_of_the_plain_cache():
    cache = _cache(max_len=16, slots=2)
    cache.commit(1, 9)  # a prompt may be committed before it is written
    cache.advance([1], 5)
    assert cache.committed == [0, 9] and cache.visible(1) == 5 == cache.lengths[1]
    cache.commit(1, 4)  # never moves back
    assert cache.committed[1] == 9
    cache.trim(1, 3)  # a plain cache can roll back anything; what it held verified shrinks with it
    assert cache.committed[1] == 3
    assert cache.stable_rows(1) == 16  # nothing is ever compressed
    cache.reset(1)
    assert cache.lengths == [0, 0] and cache.committed == [0, 0]


def test_a_float_cache_of_another_dtype_returns_the_models_dtype():
    cache = _cache(dtype=torch.bfloat16)
    k, v = _kv(1, 2)
    keys, values = cache.update(0, [0], [0], k / 7, v / 7)
    assert cache.k[0].dtype == torch.bfloat16 and keys.dtype == values.dtype == torch.float32
    assert torch.equal(keys[0], (k[0] / 7).bfloat16().float())
    model = tiny_model("llama")
    cache = model.new_cache(CacheConfig(max_len=8, kv_dtype="bfloat16"))
    assert cache.k[0].dtype == torch.bfloat16 and model.dtype == torch.float32
    assert model.new_cache(CacheConfig(max_len=8, kv_dtype="float32")).k[0].dtype == torch.float32


# --------------------------------------------------------------------------- memory accounting


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_accounting_from_shapes(dtype):
    max_len, slots = 10, 3
    cache = _cache(max_len=max_len, slots=slots, dtype=dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    per_token = 2 * LAYERS * HEADS * DIM * elem  # keys + values, every layer
    assert cache.bytes_per_token == per_token
    assert cache.nbytes == 2 * LAYERS * slots * HEADS * max_len * DIM * elem
    assert cache.nbytes == per_token * max_len * slots
    assert cache.bytes_used() == 0
    cache.advance([0], 4)
    cache.advance([2], 7)
    assert cache.bytes_used(0) == 4 * per_token
    assert cache.bytes_used(1) == 0
    assert cache.bytes_used(2) == 7 * per_token
    assert cache.bytes_used() == 11 * per_token
    cache.trim(2, 2)
    assert cache.bytes_used() == 6 * per_token


def test_model_cache_shapes_follow_model_config(model):
    c = model.config
    cache = model.new_cache(CacheConfig(max_len=32, slots=2))
    assert len(cache.k) == len(cache.v) == c.num_layers
    assert cache.k[0].shape == (2, c.num_kv_heads, 32, c.head_dim)
    assert cache.k[0].dtype == model.dtype
    assert cache.bytes_per_token == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4


# --------------------------------------------------------------------------- rollback with a real model


def test_rollback_then_rewrite_equals_never_having_written(model):
    a, b, c, x, y, d, e = 11, 22, 33, 44, 55, 66, 77
    cache = model.new_cache(CacheConfig(max_len=16))
    model(torch.tensor([[a, b, c]]), cache, logits=LogitRows.NONE)
    rejected = model(torch.tensor([[x, y]]), cache).logits  # a draft that will be rejected
    assert cache.lengths[0] == 5
    cache.trim(0, 3)
    got = model(torch.tensor([[d, e]]), cache).logits

    fresh = model.new_cache(CacheConfig(max_len=16))
    want = model(torch.tensor([[a, b, c, d, e]]), fresh).logits[:, 3:]
    assert cache.lengths == fresh.lengths == [5]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # The rejected tokens really were different: otherwise the comparison proves nothing.
    assert (rejected - want).abs().max() > 1e-2
    # And the rewrite really overwrote the stale slots.
    for layer in range(model.config.num_layers):
        torch.testing.assert_close(cache.k[layer][0, :, :5], fresh.k[layer][0, :, :5], atol=1e-4, rtol=0)


def test_rollback_without_rewrite_ignores_stale_entries(model):
    """A one-token decode after trimming must not attend to the stale tail (single row, no mask path)."""
    cache = model.new_cache(CacheConfig(max_len=16))
    model(torch.tensor([[5, 6, 7, 8, 9, 10]]), cache, logits=LogitRows.NONE)
    cache.trim(0, 2)
    got = model(torch.tensor([[40]]), cache).logits
    fresh = model.new_cache(CacheConfig(max_len=16))
    want = model(torch.tensor([[5, 6, 40]]), fresh).logits[:, -1:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- batch path


@pytest.mark.parametrize("t", [1, 3])
def test_batch_of_two_slots_with_different_lengths_equals_single_slot_path(model, t):
    seq_a = [3, 14, 15, 92, 65, 35, 89]
    seq_b = [27, 18, 28]
    new_a = [79, 32, 38][:t]
    new_b = [46, 26, 43][:t]

    batch = model.new_cache(CacheConfig(max_len=16, slots=3))
    model(torch.tensor([seq_a]), batch, slots=(2,), logits=LogitRows.NONE)
    model(torch.tensor([seq_b]), batch, slots=(0,), logits=LogitRows.NONE)
    # Leave stale garbage beyond slot 0's length, which the mask must hide.
    model(torch.tensor([[1, 2, 3, 4]]), batch, slots=(0,), logits=LogitRows.NONE)
    batch.trim(0, len(seq_b))
    got = model(torch.tensor([new_a, new_b]), batch, slots=(2, 0)).logits
    assert batch.lengths == [len(seq_b) + t, 0, len(seq_a) + t]

    for row, (seq, new) in enumerate([(seq_a, new_a), (seq_b, new_b)]):
        single = model.new_cache(CacheConfig(max_len=16))
        model(torch.tensor([seq]), single, logits=LogitRows.NONE)
        want = model(torch.tensor([new]), single).logits
        torch.testing.assert_close(got[row:row + 1], want, atol=1e-4, rtol=0)
    # The rows differ from each other, so the test would notice a row mix-up.
    assert (got[0] - got[1]).abs().max() > 1e-2
