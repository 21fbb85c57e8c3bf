"""DrafterConfig as Python callers build it: unknown kinds and settings a kind does not use are refused."""

from __future__ import annotations

import re

import pytest

from specdecode.drafter_setup import DrafterConfig


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
