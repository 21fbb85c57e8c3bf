"""The registry of drafters: each drafter's name, what it needs, what it owns, and how it is built.

Every drafter module registers its :class:`DrafterSpec` when it is imported (``drafters/__init__.py``
imports them all). The CLI, ``serve`` and ``bench`` read the registry; no other list of drafter names
exists. It holds drafters only: plain decoding (``--drafter none``) is no drafter and is handled where a
drafter is chosen (``drafter_setup.PLAIN``). It loads nothing (``drafter_setup.py`` loads draft models and
heads, and makes the shared state a spec ``needs``) and parses no flags.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from specdecode.kv.cache import CacheConfig

if TYPE_CHECKING:
    from specdecode.drafters.base import Drafter
    from specdecode.models.transformer import Transformer

TREE_WIDTH = 3  # children per expanded node of the model tree drafters (see docs/benchmarks/history.md, "Token trees")


class Needs(enum.Flag):
    """What a drafter needs besides the target."""

    NOTHING = 0
    DRAFT_MODEL = enum.auto()  # a second model with the target's vocabulary (--draft-model)
    HEAD = enum.auto()  # a trained head file (--head), or the one shipped for the target
    SKIP_SET = enum.auto()  # a set of the target's layers to skip (--skip-layers)
    # The engine's cache of finished requests' outputs, one for every slot's drafter (DrafterInputs.shared,
    # key SHARED_SUFFIX_CACHE) and bounded by the --suffix-cache-* flags: the drafter learns from earlier requests.
    SUFFIX_CACHE = enum.auto()


SHARED_SUFFIX_CACHE = "suffix"  # DrafterInputs.shared's key of the cache Needs.SUFFIX_CACHE names


@dataclass(frozen=True, kw_only=True)
class DrafterInputs:
    """What a drafter is built from, by keyword; each drafter reads the fields its spec says it needs.

    Args:
        target: the target model.
        draft_model: the separate draft model (``Needs.DRAFT_MODEL``, or a spec's ``uses`` when given).
        skip_layers: the layers to skip (``Needs.SKIP_SET``).
        ngram_sizes: (min, max) tail lengths the n-gram drafters match; None = their own defaults.
        draft_cache: the drafter's own cache settings (``DrafterSpec.owns_cache``).
        head: the head file (``Needs.HEAD``).
        draft_vocab: draft vocabulary size (0 = all tokens); None = as a head was trained, a draft model's
            default (``drafters/draft_model.py``).
        eos_ids: the target's end-of-sequence ids, in every draft vocabulary of a draft model.
        tree_width: children per expanded node of a tree drafter.
        shared: state the drafters built from these inputs share (one engine's slots), e.g. the suffix
            drafter's cache of finished requests (key SHARED_SUFFIX_CACHE; ``drafter_setup.py`` makes it, as
            the flags bound it, for a spec that ``needs`` it) or a draft model's draft vocabulary ("draft-vocab").
    """

    target: Transformer
    draft_model: Transformer | None = None
    skip_layers: tuple[int, ...] | None = None
    ngram_sizes: tuple[int, int] | None = None
    draft_cache: CacheConfig = CacheConfig()
    head: str | Path | None = None
    draft_vocab: int | None = None
    eos_ids: tuple[int, ...] = ()
    tree_width: int = TREE_WIDTH
    shared: dict[str, object] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class DrafterSpec:
    """One registered drafter.

    Args:
        name: its ``--drafter`` name.
        build: makes one drafter; raises ValueError naming what is missing.
        summary: one line for ``--help``.
        needs: what it needs besides the target.
        owns_cache: it keeps a KV cache of its own (sized and rolled back with the target's).
        tree: it drafts token trees (no per-token signals, so no ``confidence`` controller).
        head_kind: the head file kind it reads (``Needs.HEAD``).
        flags: the drafter flags it reads besides ``--drafter`` (others given with it are refused).
        uses: what it drafts with too when the user gives it (``auto``: a draft model), unlike ``needs``.
    """

    name: str
    build: Callable[[DrafterInputs], Drafter]
    summary: str
    needs: Needs = Needs.NOTHING
    owns_cache: bool = False
    tree: bool = False
    head_kind: str | None = None
    flags: tuple[str, ...] = ()
    uses: Needs = Needs.NOTHING

    @property
    def self_contained(self) -> bool:
        """Runs on the target alone (a shipped head counts): what a server can offer without other models."""
        return not self.needs & (Needs.DRAFT_MODEL | Needs.SKIP_SET)

    @property
    def learns(self) -> bool:
        """It keeps what finished requests generated (``Drafter.finish``, into ``Needs.SUFFIX_CACHE``) and drafts
        from it later."""
        return bool(self.needs & Needs.SUFFIX_CACHE)


_SPECS: dict[str, DrafterSpec] = {}


def register(spec: DrafterSpec) -> DrafterSpec:
    """Adds ``spec`` (once per name)."""
    if spec.name in _SPECS:
        raise ValueError(f"drafter {spec.name!r} is registered twice")
    _SPECS[spec.name] = spec
    return spec


def names() -> tuple[str, ...]:
    """Every registered drafter, in registration order (plain decoding is none of them)."""
    return tuple(_SPECS)


def spec(name: str) -> DrafterSpec:
    """The spec of ``name``.

    Raises:
        ValueError: no such drafter (the message lists the registered ones).
    """
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(f"unknown drafter {name!r}; expected one of {', '.join(_SPECS)}") from None


def names_where(test: Callable[[DrafterSpec], bool]) -> tuple[str, ...]:
    """The registered drafters whose spec passes ``test``, e.g. ``names_where(lambda s: s.owns_cache)``."""
    return tuple(name for name, s in _SPECS.items() if test(s))


def build(name: str, inputs: DrafterInputs) -> Drafter:
    """The drafter ``name`` built from ``inputs``: the one way to build a drafter."""
    return spec(name).build(inputs)
