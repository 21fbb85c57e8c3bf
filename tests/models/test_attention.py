"""Attention of new tokens over cached keys (``attention.py``, and our compiled attention a backend sets on a
``Block``): row-invariance on every path, and the batched forward's mask."""

from __future__ import annotations

import pytest
import torch

from specdecode.models.attention import batch_mask
from specdecode.models.build import pack_model
from kernel_paths import NATIVE_PATHS, path_params, require_path
from tiny_models import varied_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _attention_on(path: str):
    """The row-invariant attention a model packed for ``path`` runs (``Block.attend``), as a function."""
    require_path(path)
    model = varied_model(0, dtype=torch.bfloat16)
    pack_model(model, path)
    block = model.layers[0]
    assert (block.attention_ops is not None) == (path in NATIVE_PATHS)  # our compiled attention on our backends

    def attend(q, keys, values, window=None):
        block.window, block.head_dim, block.scale = window, q.shape[-1], q.shape[-1] ** -0.5
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


def test_batch_mask_hides_later_keys_and_keys_past_the_window():
    mask = batch_mask([2, 4], 2, None, torch.device("cpu"))  # row 0 holds 2 entries, row 1 holds 4; 2 new each
    assert mask.shape == (2, 1, 2, 6)
    assert mask[0, 0].tolist() == [[True] * 3 + [False] * 3, [True] * 4 + [False] * 2]
    assert mask[1, 0].tolist() == [[True] * 5 + [False], [True] * 6]
    windowed = batch_mask([4], 2, 3, torch.device("cpu"))[0, 0]
    assert windowed.tolist() == [[False, False, True, True, True, False], [False, False, False, True, True, True]]
    assert batch_mask([5, 5], 1, None, torch.device("cpu")) is None  # one new token per row, rows alike: all visible
