"""The drafter ``generate`` and ``serve`` run, as a typed config, and a maker of such drafters over loaded models.

:class:`DrafterConfig` refuses contradictory settings when it is built, before anything is loaded;
:func:`drafter_factory` loads what the drafter needs (a draft model, a head file) and returns a factory,
so that the batch engine can make one drafter per KV slot over the same loaded weights. It does not
parse flags (``flags.py`` builds the config from them) nor run anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specdecode.drafters import TREE_WIDTH, Drafter, DrafterInputs, DrafterSpec, Needs, registry
from specdecode.drafters.draft_model import check_draft_pair
from specdecode.drafters.suffix import SuffixCache
from specdecode.heads import no_head_message, shipped_head
from specdecode.kv.cache import CacheConfig
from specdecode.models import registry as models_registry
from specdecode.models.build import CHEAPEST, LoadedModel, draft_format, load_model
from specdecode.skip_sets import resolve_skip_set
from specdecode.target import TargetConfig


@dataclass(frozen=True)
class DrafterConfig:
    """Which drafter, and what it needs. Errors name the command-line flags, which map one to one.

    Args:
        kind: a registered drafter (``drafters.registry.names()``, ``--drafter``).
        draft_model: the draft model of ``draft`` and ``draft-tree`` (``--draft-model``); "auto" = the
            registered draft of the registered target (``registry.draft_for``).
        draft_quant: "int8" = int8 weight-only draft model, "none" keeps its weights (``--draft-quant``).
        draft_weights: the draft model's weight format (``--draft-weights``): "cheapest" (``build.draft_format``)
            or one of WEIGHT_FORMATS.
        head: head file of ``eagle``, ``eagle-tree`` and ``medusa``; None = the one shipped for the target.
        draft_vocab: the draft vocabulary size of a head or draft model (0 = all tokens); None = as a head was
            trained, all for a draft model.
        ngram: (min, max) n-gram sizes of ``ngram`` and ``ngram-tree``.
        tree_width: children per expanded node of ``draft-tree`` and ``eagle-tree``; None = ``TREE_WIDTH``.
        skip_layers: ``layerskip``'s skip set: a layer list such as "4,6,8-12", or "auto" (the stored
            calibration, else a new one) (``--skip-layers``).
        suffix_cache: the suffix drafters keep finished requests' outputs to draft from (``--no-suffix-cache``).
        suffix_cache_requests: most outputs kept (``--suffix-cache-requests``).
        suffix_cache_mb: most memory their suffix trie holds, in MiB (``--suffix-cache-mb``).

    Raises:
        ValueError: an unknown kind, or a flag the kind does not use (per its ``DrafterSpec.flags``).
    """

    kind: str = "ngram"
    draft_model: str | None = None
    draft_quant: str = "none"
    draft_weights: str = CHEAPEST
    head: str | None = None
    draft_vocab: int | None = None
    ngram: tuple[int, int] = (1, 3)
    tree_width: int | None = None
    skip_layers: str = "auto"
    suffix_cache: bool = True
    suffix_cache_requests: int = 1000
    suffix_cache_mb: int = 256

    def __post_init__(self) -> None:
        spec = registry.spec(self.kind)  # an unknown kind raises, listing the registered ones
        uses_model = bool(spec.needs & Needs.DRAFT_MODEL)
        if uses_model and not self.draft_model:
            raise ValueError(f"--drafter {self.kind} needs --draft-model NAME|PATH")
        if self.draft_quant != "none" and self.draft_weights != CHEAPEST:
            raise ValueError("--draft-quant int8 and --draft-weights both set the draft model's weights; give one")
        given = {"--draft-model": bool(self.draft_model), "--draft-quant": self.draft_quant != "none",
                 "--draft-weights": self.draft_weights != CHEAPEST, "--head": bool(self.head),
                 "--draft-vocab": self.draft_vocab is not None, "--tree-width": self.tree_width is not None,
                 "--skip-layers": self.skip_layers != "auto", "--no-suffix-cache": not self.suffix_cache,
                 "--suffix-cache-requests": self.suffix_cache_requests != 1000,
                 "--suffix-cache-mb": self.suffix_cache_mb != 256}
        for flag, set_ in given.items():
            if set_ and flag not in spec.flags:
                users = registry.names_where(lambda s: flag in s.flags)
                raise ValueError(f"{flag} is only used by --drafter {'|'.join(users)}, not {self.kind}")

    @property
    def spec(self) -> DrafterSpec:
        return registry.spec(self.kind)

    @property
    def has_draft_cache(self) -> bool:
        """Whether the drafter keeps a KV cache of its own (a draft model or an EAGLE head)."""
        return self.spec.owns_cache


def drafter_factory(config: DrafterConfig, target_config: TargetConfig, target: LoadedModel,
                    draft_cache: CacheConfig, log: Callable[[str], None]) -> Callable[[], Drafter | None] | None:
    """Loads what ``config``'s drafter needs and returns a maker of such drafters (None for ``none``).

    Args:
        config: the drafter.
        target_config: how the target was loaded; a draft model is loaded alike (dtype, device, kernel path).
        target: the loaded target.
        draft_cache: the draft model's (or EAGLE head's) cache settings.
        log: progress lines.
    """
    kind, spec = config.kind, config.spec
    if kind == "none":
        return None
    if spec.tree and target.model.config.mixed_windows:
        raise ValueError(f"--drafter {kind} drafts token trees, which {target_config.model} (layers with different "
                         "attention windows, as Gemma 3's) does not verify; use its chain form")
    draft_model = head = skip_layers = None
    if spec.needs & Needs.SKIP_SET:  # a bad --skip-layers is a ValueError naming it
        skip_layers = resolve_skip_set(target, target_config.dtype, config.skip_layers, progress=log)
    if spec.needs & Needs.DRAFT_MODEL:
        source = models_registry.draft_for(target_config.model) if config.draft_model == "auto" else config.draft_model
        weights = draft_format(config.draft_weights, target.model.backend) if config.draft_quant == "none" else "auto"
        log(f"loading draft model {source} ({weights} weights) ...")
        draft = load_model(source, target_config.dtype, target_config.device, progress=log,
                           linear=target_config.linear, quantize=config.draft_quant, weights=weights)
        check_draft_pair(target, draft)
        draft_model = draft.model
    if spec.needs & Needs.HEAD:
        head = config.head or shipped_head(target.model, spec.head_kind)
        if head is None:
            raise ValueError(no_head_message(spec.head_kind, target_config.model) + " with --head FILE")
    # One set of inputs for every slot's drafter: what they share (DrafterInputs.shared) is the engine's.
    eos_ids = tuple(target.tokenizer.eos_token_ids)
    inputs = DrafterInputs(target.model, draft_model, tuple(skip_layers) if skip_layers else None, config.ngram,
                           draft_cache, head, config.draft_vocab, eos_ids, config.tree_width or TREE_WIDTH)
    if "--suffix-cache-mb" in spec.flags:  # the cache the engine's suffix drafters share, as the flags bound it
        inputs.shared["suffix"] = SuffixCache(config.suffix_cache_requests, config.suffix_cache_mb << 20,
                                              config.suffix_cache)
    return lambda: registry.build(kind, inputs)
