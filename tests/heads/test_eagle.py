"""The EAGLE head's training forward computes what drafting computes: step 1 on the target's features,
and the deeper steps (training-time test) exactly as the cached drafting loop would; a block-format head
needs our kernels."""

from __future__ import annotations

import pytest
import torch

from specdecode.kv.cache import CacheConfig
from specdecode.models.backends import OneDnnBackend
from tiny_models import random_head, varied_model


@pytest.mark.parametrize("fuse", [(), (0, 1, 2)], ids=["final", "fused"])
@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_unrolled_training_forward_equals_cached_drafting(depth, fuse):
    net, _ = random_head("eagle", varied_model(0), seed=1, scale=0.2, fuse_layers=fuse)
    net.eval()
    t = 10
    g = torch.Generator().manual_seed(0)
    emb, feats = torch.randn(1, t, 64, generator=g), 3 * torch.randn(1, t, 64 * max(1, len(fuse)), generator=g)
    with torch.no_grad():
        outs = net(emb, net.normalize(feats), depth + 1)
        step = depth  # the (depth+1)-th draft token: its draft left the real rows at p - depth
        for p in range(step, t):
            cache = net.new_cache(CacheConfig(max_len=32))
            state = net.step(emb[:, :p - step + 1], net.lift(feats[:, :p - step + 1]), cache)[:, -1:]
            for j in range(step):
                row = p - step + 1 + j
                state = net.step(emb[:, row:row + 1], state, cache)
            err = (state[0, 0] - outs[step][0, p]).abs().max().item()
            assert err < 1e-4 * outs[step][0, p].abs().max().item(), (p, step, err)  # summation order only


def test_a_block_format_head_off_our_kernels_is_refused_naming_the_kernel():
    net, _ = random_head("eagle", varied_model(0))
    with pytest.raises(ValueError, match="q8_0 weights need one of our kernels .* run on onednn$"):
        net.pack(OneDnnBackend(), "q8_0")


def test_a_head_for_a_gemma3_target_is_one_full_attention_layer_at_its_scale():
    from specdecode.heads.eagle import EagleConfig
    from specdecode.models.config import ModelConfig
    from tiny_models import tiny_config

    target = tiny_config("gemma3")
    head = EagleConfig.for_target(target).layer
    assert head.num_layers == 1 and head.window_of(0) is None and not head.mixed_windows
    assert head.attention_scale == target.attention_scale and head.sandwich_norms
    back = ModelConfig.from_hf(head.to_hf())  # a head file's config reads back as the same layer
    assert back.window_of(0) is None and back.rope_theta_of(0) == head.rope_theta_of(0) == target.rope_theta
