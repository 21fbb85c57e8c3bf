"""The drafter ``generate`` and ``serve`` run, as a typed config, and a maker of such drafters over loaded models.

:class:`DrafterConfig` refuses contradictory settings when it is built, before anything is loaded;
:func:`drafter_factory` loads what the drafter needs (a draft model, a head file) and returns a factory,
so that the batch engine can make one drafter per KV slot over the same loaded weights. It does not
parse flags (``flags.py`` builds the config from them) nor run anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specdecode.drafters import DRAFTERS, HEAD_DRAFTERS, TREE_WIDTH, Drafter, base_kind, make_drafter
from specdecode.drafters.draft_model import check_draft_pair
from specdecode.heads import no_head_message, shipped_head
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import LoadedModel, load_model
from specdecode.target import TargetConfig


@dataclass(frozen=True)
class DrafterConfig:
    """Which drafter, and what it needs. Errors name the command-line flags, which map one to one.

    Args:
        kind: one of ``drafters.DRAFTERS`` (``--drafter``).
        draft_model: the draft model of ``draft`` and ``draft-tree`` (``--draft-model``).
        draft_quant: "int8" = int8 weight-only draft model, "none" keeps its weights (``--draft-quant``).
        draft_weights: the draft model's weight format (``--draft-weights``).
        head: head file of ``eagle``, ``eagle-tree`` and ``medusa``; None = the one shipped for the target.
        draft_vocab: their draft vocabulary size (0 = all tokens); None = as trained.
        ngram: (min, max) n-gram sizes of ``ngram`` and ``ngram-tree``.
        tree_width: children per expanded node of ``draft-tree`` and ``eagle-tree``; None = ``TREE_WIDTH``.

    Raises:
        ValueError: an unknown kind, or a setting the kind does not use (naming the flags).
    """

    kind: str = "ngram"
    draft_model: str | None = None
    draft_quant: str = "none"
    draft_weights: str = "auto"
    head: str | None = None
    draft_vocab: int | None = None
    ngram: tuple[int, int] = (1, 3)
    tree_width: int | None = None

    def __post_init__(self) -> None:
        kind = self.kind
        if kind not in DRAFTERS:
            raise ValueError(f"unknown drafter {kind!r}; expected one of {DRAFTERS}")
        uses_model = base_kind(kind) == "draft"
        if uses_model and not self.draft_model:
            raise ValueError(f"--drafter {kind} needs --draft-model NAME|PATH")
        if not uses_model and self.draft_model:
            raise ValueError(f"--draft-model is only used by --drafter draft|draft-tree, not {kind}")
        if not uses_model and self.draft_quant != "none":
            raise ValueError(f"--draft-quant applies to a draft model (--drafter draft|draft-tree), not {kind}")
        if not uses_model and self.draft_weights != "auto":
            raise ValueError(f"--draft-weights applies to a draft model (--drafter draft|draft-tree), not {kind}")
        if self.draft_quant != "none" and self.draft_weights != "auto":
            raise ValueError("--draft-quant int8 and --draft-weights both set the draft model's weights; give one")
        if kind not in HEAD_DRAFTERS and (self.head or self.draft_vocab is not None):
            raise ValueError(f"--head and --draft-vocab are only used by --drafter eagle|eagle-tree|medusa, not {kind}")
        if kind not in ("draft-tree", "eagle-tree") and self.tree_width is not None:
            raise ValueError(f"--tree-width is only used by --drafter draft-tree|eagle-tree, not {kind}")

    @property
    def has_draft_cache(self) -> bool:
        """Whether the drafter keeps a KV cache of its own (a draft model or an EAGLE head)."""
        return base_kind(self.kind) in ("draft", "eagle")


def drafter_factory(config: DrafterConfig, target_config: TargetConfig, target: LoadedModel,
                    draft_cache: CacheConfig, log: Callable[[str], None],
                    skip_layers: tuple[int, ...] | None = None) -> Callable[[], Drafter | None] | None:
    """Loads what ``config``'s drafter needs and returns a maker of such drafters (None for ``none``).

    Args:
        config: the drafter.
        target_config: how the target was loaded; a draft model is loaded alike (dtype, device, kernel path).
        target: the loaded target.
        draft_cache: the draft model's (or EAGLE head's) cache settings.
        log: progress lines.
        skip_layers: layerskip's skip set (resolved by the caller).
    """
    kind = config.kind
    if kind == "none":
        return None
    draft_model = head = None
    if base_kind(kind) == "draft":
        log(f"loading draft model {config.draft_model} ...")
        draft = load_model(config.draft_model, target_config.dtype, target_config.device, progress=log,
                           linear=target_config.linear, quantize=config.draft_quant, weights=config.draft_weights)
        check_draft_pair(target, draft)
        draft_model = draft.model
    if kind in HEAD_DRAFTERS:
        head = config.head or shipped_head(target.model, base_kind(kind))
        if head is None:
            raise ValueError(no_head_message(base_kind(kind), target_config.model) + " with --head FILE")
    return lambda: make_drafter(kind, target.model, draft_model, skip_layers, ngram_sizes=config.ngram,
                                draft_cache=draft_cache, head=head, draft_vocab=config.draft_vocab,
                                tree_width=config.tree_width or TREE_WIDTH)
