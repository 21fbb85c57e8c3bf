"""One decoder layer as torch modules (``block.py``): its batched and rows forms are one computation where no mask
is needed, and a token tree's key lists that are chains attend exactly as consecutive rows do."""

from __future__ import annotations

import pytest
import torch

from specdecode.kv.cache import CacheConfig
from specdecode.models.build import pack_model
from specdecode.models.rows import plan_rows
from specdecode.tree import key_index
from kernel_paths import NATIVE_PATHS, path_params
from tiny_models import varied_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(path: str):
    model = varied_model(0, dtype=torch.bfloat16)
    pack_model(model, path, fuse=False)  # the blocks' own forwards, on the path's projections and attention
    block = model.layers[0]
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(1)).bfloat16()  # [1, T, hidden]
    return model, block, x


@pytest.mark.parametrize("path", path_params(("torch", *NATIVE_PATHS)))
def test_the_batched_form_without_a_mask_is_the_rows_form(path):
    model, block, x = _setup(path)
    cos_table, sin_table = (t[0] for t in model.rope.tables(16, model.dtype))  # [P, D]: one kind of layer
    with torch.inference_mode():
        batched_cache, rows_cache = (model.new_cache(CacheConfig(max_len=16)) for _ in range(2))
        batched = block(x, 0, batched_cache, (0,), (0,), cos_table[:6][None, :, None], sin_table[:6][None, :, None],
                        None)
        plan = plan_rows(rows_cache, (0,), (6,), 6, None, None, model.device)
        rows = block.forward_rows(x, 0, rows_cache, plan, cos_table[plan.positions][None, :, None],
                                  sin_table[plan.positions][None, :, None])
    assert torch.equal(batched, rows)
    assert torch.equal(batched_cache.k[0], rows_cache.k[0]) and torch.equal(batched_cache.v[0], rows_cache.v[0])


@pytest.mark.parametrize("path", path_params(("torch", *NATIVE_PATHS)))
def test_a_chain_as_key_lists_attends_as_consecutive_rows(path):
    model, block, _ = _setup(path)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 3, 16, generator=g).bfloat16()  # [1, H, T, D]: the last 3 of 10 keys
    keys, values = (torch.randn(1, 2, 10, 16, generator=g).bfloat16() for _ in range(2))
    index, counts = key_index(7, [-1, 0, 1])  # a chain of 3 after 7 cached keys
    with torch.inference_mode():
        assert torch.equal(block.attend_indexed(q, keys, values, index, counts), block.attend(q, keys, values))
