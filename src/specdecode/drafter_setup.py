"""The drafter ``generate`` and ``serve`` run, as a typed config, and a maker of such drafters over loaded models.

:class:`DrafterConfig` refuses contradictory settings when it is built, before anything is loaded;
:func:`drafter_factory` loads what the drafter needs (a draft model, a head file), makes the state its slots
share (the suffix cache) and returns a factory, so that the batch engine can make one drafter per KV slot over
the same loaded weights. Plain decoding (:data:`PLAIN`) is chosen here like a drafter, but is none: the
registry holds drafters only. It does not parse flags (``flags.py`` builds the config from them) nor run anything.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

from specdecode.drafters import TREE_WIDTH, Drafter, DrafterInputs, DrafterSpec, Needs, NgramDrafter, registry
from specdecode.drafters.draft_model import MODEL_FLAGS, check_draft_pair
from specdecode.drafters.registry import SHARED_SUFFIX_CACHE
from specdecode.drafters.suffix import SuffixCache
from specdecode.drafters.suffix_tree import native_trie
from specdecode.heads import no_head_message, shipped_head
from specdecode.kv.cache import CacheConfig
from specdecode.models import registry as models_registry
from specdecode.models.build import CHEAPEST, LoadedModel, draft_format, load_model
from specdecode.models.transformer import Transformer
from specdecode.skip_sets import resolve_skip_set
from specdecode.target import TargetConfig

PLAIN = "none"  # --drafter none: plain decoding, no drafter (the registry holds drafters only)

# The drafter flags and the DrafterConfig fields they set; a flag is given when its field is not the default.
FLAG_FIELDS = {"--draft-model": "draft_model", "--draft-quant": "draft_quant", "--draft-weights": "draft_weights",
               "--head": "head", "--draft-vocab": "draft_vocab", "--ngram": "ngram", "--tree-width": "tree_width",
               "--skip-layers": "skip_layers", "--no-suffix-cache": "suffix_cache",
               "--suffix-cache-requests": "suffix_cache_requests", "--suffix-cache-mb": "suffix_cache_mb"}


@dataclass(frozen=True)
class DrafterConfig:
    """Which drafter, and what it needs. Errors name the command-line flags, which map one to one (FLAG_FIELDS);
    the fields' defaults are the flags' defaults.

    Args:
        kind: PLAIN ("none": plain decoding) or a registered drafter (``drafters.registry.names()``,
            ``--drafter``).
        draft_model: the draft model of ``draft`` and ``draft-tree`` (``--draft-model``); "auto" = the
            registered draft of the registered target (``registry.draft_for``).
        draft_quant: "int8" = int8 weight-only draft model, "none" keeps its weights (``--draft-quant``).
        draft_weights: the draft model's weight format (``--draft-weights``): "cheapest" (``build.draft_format``)
            or one of WEIGHT_FORMATS.
        head: head file of ``eagle``, ``eagle-tree`` and ``medusa``; None = the one shipped for the target.
        draft_vocab: the draft vocabulary size of a head or draft model (0 = all tokens); None = as a head was
            trained, ``draft_model.DRAFT_VOCAB`` for a draft model.
        ngram: (min, max) n-gram sizes of ``ngram`` and ``ngram-tree`` (default: ``NgramDrafter``'s).
        tree_width: children per expanded node of ``draft-tree`` and ``eagle-tree``; None = ``TREE_WIDTH`` (so
            that ``--tree-width`` given at that value is still refused for other drafters).
        skip_layers: ``layerskip``'s skip set: a layer list such as "4,6,8-12", or "auto" (the stored
            calibration, else a new one) (``--skip-layers``).
        suffix_cache: the suffix drafters keep finished requests' outputs to draft from (``--no-suffix-cache``).
        suffix_cache_requests: most outputs kept (``--suffix-cache-requests``; default: ``SuffixCache``'s).
        suffix_cache_mb: most memory their suffix trie holds, in MiB (``--suffix-cache-mb``; default:
            ``SuffixCache``'s).

    Raises:
        ValueError: an unknown kind, or a flag the kind does not use (per its ``DrafterSpec.flags``).
    """

    kind: str = "auto"
    draft_model: str | None = None
    draft_quant: str = "none"
    draft_weights: str = CHEAPEST
    head: str | None = None
    draft_vocab: int | None = None
    ngram: tuple[int, int] = (NgramDrafter.min_ngram, NgramDrafter.max_ngram)
    tree_width: int | None = None
    skip_layers: str = "auto"
    suffix_cache: bool = SuffixCache.enabled
    suffix_cache_requests: int = SuffixCache.max_requests
    suffix_cache_mb: int = SuffixCache.max_bytes >> 20

    def __post_init__(self) -> None:
        if self.kind != PLAIN and self.kind not in registry.names():
            raise ValueError(f"unknown drafter {self.kind!r}; expected {PLAIN} (plain decoding) or one of "
                             f"{', '.join(registry.names())}")
        if self.needs & Needs.DRAFT_MODEL and not self.draft_model:
            raise ValueError(f"--drafter {self.kind} needs --draft-model NAME|PATH")
        if self.draft_quant != "none" and self.draft_weights != CHEAPEST:
            raise ValueError("--draft-quant int8 and --draft-weights both set the draft model's weights; give one")
        reads = self.spec.flags if self.spec is not None else ()
        for flag in self.given():
            if flag not in reads:
                users = registry.names_where(lambda s: flag in s.flags)
                raise ValueError(f"{flag} is only used by --drafter {'|'.join(users)}, not {self.kind}")
        model_flags = [f for f in self.given() if f in MODEL_FLAGS and f != "--draft-model"]
        if model_flags and not self.draft_model and self.spec.uses & Needs.DRAFT_MODEL:  # (a head reads --draft-vocab)
            raise ValueError(f"{model_flags[0]} sets the draft model, which needs --draft-model NAME|PATH")

    def given(self) -> list[str]:
        """The drafter flags set to other than their defaults."""
        defaults = {f.name: f.default for f in fields(self)}
        return [flag for flag, name in FLAG_FIELDS.items() if getattr(self, name) != defaults[name]]

    @property
    def speculates(self) -> bool:
        """Whether it drafts at all: False for plain decoding."""
        return self.kind != PLAIN

    @property
    def spec(self) -> DrafterSpec | None:
        """The registered drafter's spec; None for plain decoding."""
        return registry.spec(self.kind) if self.speculates else None

    @property
    def needs(self) -> Needs:
        """What the drafter needs besides the target (nothing for plain decoding)."""
        return self.spec.needs if self.spec is not None else Needs.NOTHING

    @property
    def uses_draft_model(self) -> bool:
        """Whether it drafts with a draft model: one it needs, or one it uses when given (``auto``)."""
        return bool(self.needs & Needs.DRAFT_MODEL) or (self.spec is not None and bool(self.draft_model)
                                                          and bool(self.spec.uses & Needs.DRAFT_MODEL))

    @property
    def has_draft_cache(self) -> bool:
        """Whether the drafter keeps a KV cache of its own (a draft model or an EAGLE head)."""
        return self.spec is not None and (self.spec.owns_cache or self.uses_draft_model)


def drafter_factory(config: DrafterConfig, target_config: TargetConfig, target: LoadedModel,
                    draft_cache: CacheConfig, log: Callable[[str], None]) -> Callable[[], Drafter] | None:
    """Loads what ``config``'s drafter needs and returns a maker of such drafters (None for plain decoding).

    Args:
        config: the drafter.
        target_config: how the target was loaded; a draft model is loaded alike (dtype, device, kernel path).
        target: the loaded target.
        draft_cache: the draft model's (or EAGLE head's) cache settings.
        log: progress lines.
    """
    spec = config.spec
    if spec is None:
        return None
    if spec.tree and target.model.config.mixed_windows:
        raise ValueError(f"--drafter {spec.name} drafts token trees, which {target_config.model} (layers with "
                         "different attention windows, as Gemma 3's) does not verify; use its chain form")
    draft_model = head = skip_layers = None
    if spec.needs & Needs.SKIP_SET:  # a bad --skip-layers is a ValueError naming it
        skip_layers = tuple(resolve_skip_set(target, target_config.dtype, config.skip_layers, progress=log))
    if config.uses_draft_model:
        draft_model = _load_draft(config, target_config, target, log)
    if spec.needs & Needs.HEAD:
        head = config.head or shipped_head(target.model, spec.head_kind)
        if head is None:
            raise ValueError(no_head_message(spec.head_kind, target_config.model) + " with --head FILE")
    # One set of inputs for every slot's drafter: what they share (DrafterInputs.shared) is the engine's.
    inputs = DrafterInputs(target=target.model, draft_model=draft_model, skip_layers=skip_layers or None,
                           ngram_sizes=config.ngram, draft_cache=draft_cache, head=head, draft_vocab=config.draft_vocab,
                           eos_ids=tuple(target.tokenizer.eos_token_ids),
                           tree_width=config.tree_width or TREE_WIDTH)
    if spec.needs & Needs.SUFFIX_CACHE:  # the cache the engine's suffix drafters share, as the flags bound it
        native_trie(log)  # built now, with a progress line, rather than silently at the first request
        inputs.shared[SHARED_SUFFIX_CACHE] = SuffixCache(config.suffix_cache_requests, config.suffix_cache_mb << 20,
                                                         config.suffix_cache)
    return lambda: registry.build(spec.name, inputs)


def _load_draft(config: DrafterConfig, target_config: TargetConfig, target: LoadedModel,
                log: Callable[[str], None]) -> Transformer:
    """The draft model ``config`` names, loaded as the target was, checked to pair with it."""
    source = models_registry.draft_for(target_config.model) if config.draft_model == "auto" else config.draft_model
    weights = draft_format(config.draft_weights, target.model.backend) if config.draft_quant == "none" else "auto"
    log(f"loading draft model {source} ({weights} weights) ...")
    draft = load_model(source, target_config.dtype, target_config.device, progress=log,
                       linear=target_config.linear, quantize=config.draft_quant, weights=weights)
    check_draft_pair(target, draft)
    return draft.model
