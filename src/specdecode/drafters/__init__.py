"""Ways to propose draft tokens; the engine verifies them all with one target forward."""

from __future__ import annotations

from typing import Sequence

from specdecode.drafters.base import Draft, Drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.layer_skip import LayerSkipDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.kv.cache import CacheConfig
from specdecode.models.transformer import Transformer

DRAFTERS = ("none", "ngram", "draft", "layerskip")


def make_drafter(kind: str, target: Transformer, draft_model: Transformer | None = None,
                 skip_layers: Sequence[int] | None = None, ngram_sizes: tuple[int, int] = (1, 3),
                 draft_cache: CacheConfig = CacheConfig()) -> Drafter | None:
    """Builds the drafter a name asks for (None for "none").

    Args:
        kind: one of DRAFTERS.
        target: the target model (layerskip drafts with it).
        draft_model: the separate draft model, required by "draft".
        skip_layers: layers layerskip skips, required by "layerskip".
        ngram_sizes: (min, max) tail lengths ngram matches.
        draft_cache: the draft model's cache settings ("draft" only).
    """
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(min_ngram=ngram_sizes[0], max_ngram=ngram_sizes[1])
    if kind == "draft":
        if draft_model is None:
            raise ValueError("drafter 'draft' needs a draft model (--draft-model NAME|PATH)")
        return DraftModelDrafter(draft_model, target, draft_cache)
    if kind == "layerskip":
        if not skip_layers:
            raise ValueError("drafter 'layerskip' needs a set of layers to skip")
        return LayerSkipDrafter(target, skip_layers)
    raise ValueError(f"unknown drafter {kind!r}; expected one of {DRAFTERS}")


__all__ = ["DRAFTERS", "Draft", "Drafter", "DraftModelDrafter", "LayerSkipDrafter", "NgramDrafter", "make_drafter"]
