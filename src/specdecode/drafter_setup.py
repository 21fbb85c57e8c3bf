"""The drafter flags of ``generate`` and ``serve``, and the drafter they ask for, built from loaded models.

One place decides which drafter the flags mean, refuses contradictory ones before anything is loaded,
and loads what the drafter needs (a draft model, a head file, a layer-skip calibration). It returns a
factory, so that the batch engine can make one drafter per KV slot over the same loaded weights.
It does not run anything.
"""

from __future__ import annotations

import argparse
from typing import Callable

from specdecode.argtypes import ngram_sizes, positive_int
from specdecode.drafters import DRAFTERS, HEAD_DRAFTERS, TREE_WIDTH, Drafter, base_kind, make_drafter
from specdecode.drafters.draft_model import check_draft_pair
from specdecode.heads import no_head_message, shipped_head
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import DRAFT_QUANT, LoadedModel, load_model
from specdecode.models.weights import WEIGHT_FORMATS


def add_drafter_arguments(p: argparse.ArgumentParser, kinds: tuple[str, ...] = DRAFTERS) -> None:
    p.add_argument("--drafter", choices=kinds, default=None,
                   help="how to draft (default: draft when --draft-model is given, else ngram)")
    p.add_argument("--draft-model", default=None, help="draft model for --drafter draft (same vocabulary as --model)")
    p.add_argument("--draft-quant", choices=DRAFT_QUANT, default="none",
                   help="int8 = int8 weight-only draft model (torch's kernel, any path): cheaper drafts, output still "
                        "exact (default none; on our kernels --draft-weights q8_0 is faster)")
    p.add_argument("--draft-weights", choices=WEIGHT_FORMATS, default="auto",
                   help="the draft model's weight format, as --weights is the target's (default auto)")
    p.add_argument("--head", default=None, metavar="FILE",
                   help="head file for --drafter eagle|medusa (default: the head shipped for --model, if any)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="--drafter eagle|medusa: draft over the N most frequent tokens (0 = all; default: as trained)")
    p.add_argument("--ngram", type=ngram_sizes, default=(1, 3), help="min,max n-gram sizes for ngram lookup (default 1,3)")
    p.add_argument("--tree-width", type=positive_int, default=None, metavar="W",
                   help=f"--drafter draft-tree|eagle-tree: children per expanded node (default {TREE_WIDTH})")


def drafter_kind(args: argparse.Namespace) -> str:
    """The drafter the flags ask for; refuses contradictory flags (ValueError) before anything is loaded."""
    kind = args.drafter or ("draft" if args.draft_model else "ngram")
    uses_model = base_kind(kind) == "draft"
    if uses_model and not args.draft_model:
        raise ValueError(f"--drafter {kind} needs --draft-model NAME|PATH")
    if not uses_model and args.draft_model:
        raise ValueError(f"--draft-model is only used by --drafter draft|draft-tree, not {kind}")
    if not uses_model and args.draft_quant != "none":
        raise ValueError(f"--draft-quant applies to a draft model (--drafter draft|draft-tree), not {kind}")
    if not uses_model and getattr(args, "draft_weights", "auto") != "auto":
        raise ValueError(f"--draft-weights applies to a draft model (--drafter draft|draft-tree), not {kind}")
    if args.draft_quant != "none" and getattr(args, "draft_weights", "auto") != "auto":
        raise ValueError("--draft-quant int8 and --draft-weights both set the draft model's weights; give one")
    if kind not in HEAD_DRAFTERS and (args.head or args.draft_vocab is not None):
        raise ValueError(f"--head and --draft-vocab are only used by --drafter eagle|eagle-tree|medusa, not {kind}")
    if kind not in ("draft-tree", "eagle-tree") and getattr(args, "tree_width", None) is not None:
        raise ValueError(f"--tree-width is only used by --drafter draft-tree|eagle-tree, not {kind}")
    return kind


def drafter_factory(args: argparse.Namespace, target: LoadedModel, draft_cache: CacheConfig,
                    log: Callable[[str], None], skip_layers: tuple[int, ...] | None = None
                    ) -> Callable[[], Drafter | None] | None:
    """Loads what the flags' drafter needs and returns a maker of such drafters (None for ``--drafter none``).

    Args:
        args: parsed flags (see :func:`add_drafter_arguments`, plus the model flags).
        target: the loaded target.
        draft_cache: the draft model's (or EAGLE head's) cache settings.
        log: progress lines.
        skip_layers: layerskip's skip set (resolved by the caller).
    """
    kind = drafter_kind(args)
    if kind == "none":
        return None
    draft_model = head = None
    if base_kind(kind) == "draft":
        log(f"loading draft model {args.draft_model} ...")
        draft = load_model(args.draft_model, args.dtype, args.device, progress=log, linear=args.linear,
                           quantize=args.draft_quant, weights=args.draft_weights)
        check_draft_pair(target, draft)
        draft_model = draft.model
    if kind in HEAD_DRAFTERS:
        head = args.head or shipped_head(target.model, base_kind(kind))
        if head is None:
            raise ValueError(no_head_message(base_kind(kind), args.model) + " with --head FILE")
    return lambda: make_drafter(kind, target.model, draft_model, skip_layers, ngram_sizes=args.ngram,
                                draft_cache=draft_cache, head=head, draft_vocab=args.draft_vocab,
                                tree_width=args.tree_width or TREE_WIDTH)
