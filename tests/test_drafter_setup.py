"""DrafterConfig as Python callers build it: unknown kinds and settings a kind does not use are refused."""

from __future__ import annotations

import re

import pytest

from specdecode.drafter_setup import DrafterConfig, drafter_factory
from specdecode.kv.cache import CacheConfig
from specdecode.target import TargetConfig
from tiny_models import write_tiny_hf_model


def test_a_drafter_config_names_what_is_wrong():
    with pytest.raises(ValueError, match="unknown drafter 'warp'"):
        DrafterConfig(kind="warp")
    with pytest.raises(ValueError, match="--drafter draft-tree needs --draft-model"):
        DrafterConfig(kind="draft-tree")
    with pytest.raises(ValueError, match=re.escape("--tree-width is only used by --drafter draft-tree|eagle-tree, not eagle")):
        DrafterConfig(kind="eagle", tree_width=2)


@pytest.mark.parametrize("config, own_cache", [
    (DrafterConfig(), False), (DrafterConfig("layerskip"), False), (DrafterConfig("medusa"), False),
    (DrafterConfig("eagle-tree", tree_width=2), True), (DrafterConfig("draft", draft_model="d"), True),
])
def test_only_draft_models_and_eagle_heads_keep_a_cache(config, own_cache):
    assert config.has_draft_cache == own_cache


def test_skip_layers_belong_to_layerskip_and_are_resolved_when_it_is_loaded(tmp_path):
    with pytest.raises(ValueError, match=re.escape("--skip-layers is only used by --drafter layerskip, not ngram")):
        DrafterConfig(kind="ngram", skip_layers="1")
    target_config = TargetConfig(str(write_tiny_hf_model(tmp_path / "tiny")), dtype="float32", device="cpu")
    target = target_config.load()
    new = drafter_factory(DrafterConfig(kind="layerskip", skip_layers="1,2"), target_config, target, CacheConfig(),
                          lambda line: None)
    assert new().skip == (1, 2)  # each slot's drafter skips the layers the flag names
    with pytest.raises(ValueError, match="out of range"):
        drafter_factory(DrafterConfig(kind="layerskip", skip_layers="99"), target_config, target, CacheConfig(),
                        lambda line: None)


def test_the_suffix_cache_flags_belong_to_the_suffix_drafters_and_bound_one_shared_cache(tmp_path):
    with pytest.raises(ValueError, match=re.escape("--suffix-cache-mb is only used by --drafter suffix|suffix-tree, "
                                                   "not ngram")):
        DrafterConfig(kind="ngram", suffix_cache_mb=8)
    with pytest.raises(ValueError, match="--no-suffix-cache is only used by"):
        DrafterConfig(kind="none", suffix_cache=False)
    target_config = TargetConfig(str(write_tiny_hf_model(tmp_path / "tiny")), dtype="float32", device="cpu")
    target = target_config.load()
    new = drafter_factory(DrafterConfig(kind="suffix", suffix_cache_requests=3, suffix_cache_mb=8),
                          target_config, target, CacheConfig(), lambda line: None)
    first, second = new(), new()
    assert first.cache is second.cache  # one cache per engine, shared by every slot's drafter
    assert (first.cache.max_requests, first.cache.max_bytes, first.cache.enabled) == (3, 8 << 20, True)
    off = drafter_factory(DrafterConfig(kind="suffix", suffix_cache=False), target_config, target, CacheConfig(),
                          lambda line: None)()
    assert off.cache.enabled is False and off.cache is not first.cache
