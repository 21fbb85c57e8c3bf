"""Ways to propose draft tokens; the engine verifies them all with one target forward.

Importing this package registers every drafter (``registry.py``): a new drafter is one module that
registers its ``DrafterSpec``, plus its import here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from specdecode.drafters import registry
from specdecode.drafters.base import Draft, Drafter
# Import order is registration order, which is the order --help, bench tables and reports list drafters in.
from specdecode.drafters.ngram import NgramDrafter  # isort: skip
from specdecode.drafters.ngram_tree import NgramTreeDrafter  # isort: skip
from specdecode.drafters.suffix import SuffixDrafter  # isort: skip
from specdecode.drafters.draft_model import DraftModelDrafter  # isort: skip
from specdecode.drafters.layer_skip import LayerSkipDrafter  # isort: skip
from specdecode.drafters.head_loader import load_head_drafter  # isort: skip
from specdecode.drafters.eagle import EagleDrafter  # isort: skip
from specdecode.drafters.medusa import MedusaDrafter  # isort: skip
from specdecode.drafters.registry import TREE_WIDTH, DrafterInputs, DrafterSpec, Needs
from specdecode.kv.cache import CacheConfig
from specdecode.models.transformer import Transformer


def make_drafter(kind: str, target: Transformer, draft_model: Transformer | None = None,
                 skip_layers: Sequence[int] | None = None, ngram_sizes: tuple[int, int] = (1, 3),
                 draft_cache: CacheConfig = CacheConfig(), head: str | Path | None = None,
                 draft_vocab: int | None = None, tree_width: int = TREE_WIDTH,
                 eos_ids: Iterable[int] = ()) -> Drafter | None:
    """Builds the registered drafter ``kind`` (None for "none"); what it needs but lacks raises ValueError.

    Args:
        kind: a registered name (``registry.names()``).
        target: the target model (layerskip drafts with it).
        draft_model: the separate draft model (``Needs.DRAFT_MODEL``).
        skip_layers: the layers layerskip skips (``Needs.SKIP_SET``).
        ngram_sizes: (min, max) tail lengths the n-gram drafters match.
        draft_cache: the draft model's (or EAGLE head's) cache settings.
        head: the head file (``Needs.HEAD``; its kind must match).
        draft_vocab: draft vocabulary size (0 = all tokens); None = as a head was trained, all for a draft
            model.
        tree_width: children per expanded node of the model tree drafters (``drafters/tree_search.py``).
        eos_ids: the target's end-of-sequence ids, kept in a draft model's draft vocabulary.
    """
    inputs = DrafterInputs(target, draft_model, tuple(skip_layers) if skip_layers else None, ngram_sizes,
                           draft_cache, head, draft_vocab, tuple(eos_ids), tree_width)
    return registry.build(kind, inputs)


__all__ = ["TREE_WIDTH", "Draft", "Drafter", "DraftModelDrafter", "DrafterInputs", "DrafterSpec", "EagleDrafter",
           "LayerSkipDrafter", "MedusaDrafter", "Needs", "NgramDrafter", "NgramTreeDrafter", "SuffixDrafter",
           "load_head_drafter", "make_drafter", "registry"]
