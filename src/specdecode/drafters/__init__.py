"""Ways to propose draft tokens; the engine verifies them all with one target forward.

Importing this package registers every drafter (``registry.py``): a new drafter is one module that
registers its ``DrafterSpec``, plus its import here. A drafter is built one way, ``registry.build(name,
DrafterInputs(...))``; plain decoding is no drafter here (``drafter_setup.PLAIN``).
"""

from __future__ import annotations

from specdecode.drafters import registry
from specdecode.drafters.base import Draft, Drafter
# Import order is registration order, which is the order --help, bench tables and reports list drafters in.
from specdecode.drafters.ngram import NgramDrafter  # isort: skip
from specdecode.drafters.ngram_tree import NgramTreeDrafter  # isort: skip
from specdecode.drafters.suffix import SuffixDrafter  # isort: skip
from specdecode.drafters.auto import AutoDrafter  # isort: skip
from specdecode.drafters.draft_model import DraftModelDrafter  # isort: skip
from specdecode.drafters.layer_skip import LayerSkipDrafter  # isort: skip
from specdecode.drafters.head_loader import load_head_drafter  # isort: skip
from specdecode.drafters.eagle import EagleDrafter  # isort: skip
from specdecode.drafters.medusa import MedusaDrafter  # isort: skip
from specdecode.drafters.registry import TREE_WIDTH, DrafterInputs, DrafterSpec, Needs

__all__ = ["TREE_WIDTH", "AutoDrafter", "Draft", "Drafter", "DraftModelDrafter", "DrafterInputs", "DrafterSpec", "EagleDrafter",
           "LayerSkipDrafter", "MedusaDrafter", "Needs", "NgramDrafter", "NgramTreeDrafter", "SuffixDrafter",
           "load_head_drafter", "registry"]
