"""Ways to propose draft tokens; the engine verifies them all with one target forward."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from specdecode.drafters.base import Draft, Drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.head_loader import load_head_drafter
from specdecode.drafters.layer_skip import LayerSkipDrafter
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.ngram_tree import NgramTreeDrafter
from specdecode.kv.cache import CacheConfig
from specdecode.models.transformer import Transformer

DRAFTERS = ("none", "ngram", "ngram-tree", "draft", "draft-tree", "layerskip", "eagle", "eagle-tree", "medusa")
# Trained heads: a head file, or the one shipped for the target (eagle-tree uses the eagle head).
HEAD_DRAFTERS = ("eagle", "eagle-tree", "medusa")
TREE_WIDTH = 3  # children per expanded node of draft-tree and eagle-tree (see docs/benchmarks/history.md, "Token trees")


def base_kind(kind: str) -> str:
    """The chain drafter a tree drafter grows from ("eagle-tree" -> "eagle"); chain kinds unchanged."""
    return kind.removesuffix("-tree")


def make_drafter(kind: str, target: Transformer, draft_model: Transformer | None = None,
                 skip_layers: Sequence[int] | None = None, ngram_sizes: tuple[int, int] = (1, 3),
                 draft_cache: CacheConfig = CacheConfig(), head: str | Path | None = None,
                 draft_vocab: int | None = None, tree_width: int = TREE_WIDTH) -> Drafter | None:
    """Builds the drafter a name asks for (None for "none").

    Args:
        kind: one of DRAFTERS.
        target: the target model (layerskip drafts with it).
        draft_model: the separate draft model, required by "draft".
        skip_layers: layers layerskip skips, required by "layerskip".
        ngram_sizes: (min, max) tail lengths ngram and ngram-tree match.
        draft_cache: the draft model's (or EAGLE head's) cache settings.
        head: the head file of "eagle" / "medusa" (its kind must match), required by them.
        draft_vocab: their draft vocabulary size (0 = all tokens); None = the one the head was trained with.
        tree_width: children per expanded node of the "-tree" model drafters (``drafters/tree_search.py``).
    """
    width = tree_width if kind.endswith("-tree") else 0
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(min_ngram=ngram_sizes[0], max_ngram=ngram_sizes[1])
    if kind == "ngram-tree":
        return NgramTreeDrafter(min_ngram=ngram_sizes[0], max_ngram=ngram_sizes[1])
    if base_kind(kind) == "draft":
        if draft_model is None:
            raise ValueError(f"drafter {kind!r} needs a draft model (--draft-model NAME|PATH)")
        return DraftModelDrafter(draft_model, target, draft_cache, width)
    if kind == "layerskip":
        if not skip_layers:
            raise ValueError("drafter 'layerskip' needs a set of layers to skip")
        return LayerSkipDrafter(target, skip_layers)
    if kind in HEAD_DRAFTERS:
        if head is None:
            raise ValueError(f"drafter {kind!r} needs a head file (--head FILE)")
        drafter = load_head_drafter(head, target, draft_cache, draft_vocab, width)
        if base_kind(drafter.name) != base_kind(kind):
            raise ValueError(f"{head}: is a {base_kind(drafter.name)} head, not a {base_kind(kind)} head")
        return drafter
    raise ValueError(f"unknown drafter {kind!r}; expected one of {DRAFTERS}")


__all__ = ["DRAFTERS", "HEAD_DRAFTERS", "TREE_WIDTH", "base_kind", "Draft", "Drafter", "DraftModelDrafter", "EagleDrafter", "LayerSkipDrafter",
           "MedusaDrafter", "NgramDrafter", "NgramTreeDrafter", "make_drafter"]
