"""Pre-packed oneDNN linears: bitwise the same numbers as F.linear in bf16, at every row count we run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.linear import PackedLinear, can_pack

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="needs oneDNN bf16 on CPU")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear_bitwise(rows, bias):
    g = torch.Generator().manual_seed(rows)
    layer = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(1, rows, 96, generator=g).to(torch.bfloat16)  # [B, T, in]
    packed = PackedLinear.from_linear(layer)
    with torch.inference_mode():
        got = packed(x)
        assert got.shape == (1, rows, 160)
        assert torch.equal(got, F.linear(x, layer.weight, layer.bias))


def test_packing_refuses_float32_and_reports_bytes():
    with pytest.raises(ValueError, match="cannot pack a torch.float32 weight"):
        PackedLinear(torch.zeros(4, 4))
    packed = PackedLinear(torch.zeros(8, 4, dtype=torch.bfloat16))
    assert packed.nbytes == 8 * 4 * 2 and "packed" in repr(packed)
