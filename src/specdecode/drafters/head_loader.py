"""A head file (``heads/file.py``) made into a ready drafter: EAGLE-style or Medusa-style, by the file's kind.

It checks that the file was made for the target and that its weights fit its own config, builds the head
in the target's dtype, device and kernel path, and picks the draft vocabulary. It does not train heads
nor find the shipped ones (``heads/``).
"""

from __future__ import annotations

from pathlib import Path

from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.drafters.registry import DrafterInputs, DrafterSpec, Needs, register
from specdecode.heads import new_head
from specdecode.heads.eagle import check_fuse_layers
from specdecode.heads.file import HeadFileError, check_target, load_head
from specdecode.heads.vocab import VocabHead, draft_ids
from specdecode.kv.cache import CacheConfig
from specdecode.models.transformer import Transformer


def load_head_drafter(path: str | Path, target: Transformer, cache: CacheConfig = CacheConfig(),
                      draft_vocab: int | None = None, tree_width: int = 0,
                      kind: str | None = None) -> EagleDrafter | MedusaDrafter:
    """A ready ``EagleDrafter`` or ``MedusaDrafter`` from a head file, in the target's dtype, on its device
    and kernel path. Where the target computes with block-format weights, the EAGLE layer is quantized to
    q8_0 and the draft vocabulary scores with the target's own head blocks.

    Args:
        path: the head file.
        target: the target ``Transformer``.
        cache: the EAGLE head cache's settings.
        draft_vocab: draft vocabulary size (the most frequent tokens first; 0 = all); None = as trained.
        tree_width: an EAGLE head drafts trees with this many children per expanded node (0: chains).
        kind: the head kind the caller expects ("eagle" or "medusa"); None = either.

    Raises:
        HeadFileError: unreadable, corrupt, or made for another model (the message names the file and the mismatch).
    """
    head = load_head(path)
    if kind is not None and head.kind != kind:
        raise HeadFileError(f"{path}: is a {head.kind} head, not a {kind} head")
    check_target(path, head.target, target)
    try:
        net = new_head(head.kind, head.config)
        net.load_state_dict(head.weights, strict=True)
    except (KeyError, ValueError, RuntimeError, TypeError) as err:
        raise HeadFileError(f"{path}: weights do not fit a {head.kind} head of its own config ({err})") from None
    if head.kind == "eagle":
        try:
            check_fuse_layers(net.head_config.fuse_layers, target.config.num_layers)
        except ValueError as err:
            raise HeadFileError(f"{path}: {err}") from None
    vocab_size = target.config.vocab_size
    if head.vocab.numel() == 0 or int(head.vocab.min()) < 0 or int(head.vocab.max()) >= vocab_size:
        raise HeadFileError(f"{path}: draft vocabulary ids must lie in 0..{vocab_size - 1}")
    if draft_vocab is not None and draft_vocab < 0:
        raise ValueError(f"draft vocabulary size must be >= 0 (0 = all tokens), got {draft_vocab}")
    net = net.to(target.device, target.dtype).eval().requires_grad_(False)
    vocab = VocabHead(target, draft_ids(head.vocab, head.draft_vocab if draft_vocab is None else draft_vocab))
    if head.kind == "eagle":
        net.pack_like(target)
        return EagleDrafter(target, net, vocab, cache, tree_width)
    return MedusaDrafter(target, net, vocab)


def _build(inputs: DrafterInputs, name: str, kind: str, tree_width: int) -> EagleDrafter | MedusaDrafter:
    if inputs.head is None:
        raise ValueError(f"drafter {name!r} needs a head file (--head FILE)")
    return load_head_drafter(inputs.head, inputs.target, inputs.draft_cache, inputs.draft_vocab, tree_width, kind)


_HEAD_FLAGS = ("--head", "--draft-vocab")
register(DrafterSpec("eagle", lambda i: _build(i, "eagle", "eagle", 0), "a trained EAGLE-style head on the target's features",
                     Needs.HEAD, owns_cache=True, head_kind="eagle", flags=_HEAD_FLAGS))
register(DrafterSpec("eagle-tree", lambda i: _build(i, "eagle-tree", "eagle", i.tree_width), "an EAGLE head searching a token tree",
                     Needs.HEAD, owns_cache=True, tree=True, head_kind="eagle", flags=(*_HEAD_FLAGS, "--tree-width")))
register(DrafterSpec("medusa", lambda i: _build(i, "medusa", "medusa", 0), "trained Medusa-style heads, one per position",
                     Needs.HEAD, head_kind="medusa", flags=_HEAD_FLAGS))
