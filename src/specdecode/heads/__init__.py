"""Trained draft heads on the target's own features: EAGLE-style (``eagle.py``) and Medusa-style
(``medusa.py``), their file format (``file.py``), draft vocabulary (``vocab.py``), training data
(``data.py``) and training (``train.py``).

This module builds a head of either kind, and loads a head file into a ready drafter, refusing a file
made for another model. Heads for the registry's SmolLM2 ship with the package (``data/``), found by the
target's weights fingerprint.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from torch import nn

from specdecode.heads.eagle import EagleConfig, EagleHead, check_fuse_layers
from specdecode.heads.file import HeadFileError, check_target, load_head, read_metadata, target_identity
from specdecode.heads.medusa import MedusaConfig, MedusaHeads
from specdecode.heads.vocab import VocabHead, draft_ids
from specdecode.kv.cache import CacheConfig

HEAD_KINDS = ("eagle", "medusa")


def new_head(kind: str, config: dict) -> nn.Module:
    """An untrained head of ``kind`` from its config dict (as stored in a head file)."""
    if kind == "eagle":
        return EagleHead(EagleConfig.from_dict(config))
    if kind == "medusa":
        return MedusaHeads(MedusaConfig.from_dict(config))
    raise ValueError(f"head kind {kind!r} is not one of {HEAD_KINDS}")


def shipped_heads() -> list[Path]:
    """The head files packaged in ``heads/data/``."""
    return sorted(Path(str(resources.files("specdecode.heads") / "data")).glob("*.safetensors"))


def shipped_head(model, kind: str) -> Path | None:
    """The packaged head of ``kind`` trained for ``model`` (matched by its weights, however it was loaded), or None."""
    fingerprint = target_identity(model)["fingerprint"]
    for path in shipped_heads():
        meta = read_metadata(path)
        if meta.get("kind") == kind and json.loads(meta.get("target", "{}")).get("fingerprint") == fingerprint:
            return path
    return None


def no_head_message(kind: str, source: str) -> str:
    return (f"no {kind} head ships for {source}; train one with `specdecode train-head --model {source} --kind {kind} "
            "--out FILE` and pass its file")


def load_head_drafter(path: str | Path, target, cache: CacheConfig = CacheConfig(), draft_vocab: int | None = None,
                      tree_width: int = 0):
    """A ready ``EagleDrafter`` or ``MedusaDrafter`` from a head file, in the target's dtype, on its device
    and kernel path. Where the target computes with block-format weights, the EAGLE layer is quantized to
    q8_0 and the draft vocabulary scores with the target's own head blocks.

    Args:
        path: the head file.
        target: the target ``Transformer``.
        cache: the EAGLE head cache's settings.
        draft_vocab: draft vocabulary size (the most frequent tokens first; 0 = all); None = as trained.
        tree_width: an EAGLE head drafts trees with this many children per expanded node (0: chains).

    Raises:
        HeadFileError: unreadable, corrupt, or made for another model (the message names the file and the mismatch).
    """
    from specdecode.drafters.eagle import EagleDrafter
    from specdecode.drafters.medusa import MedusaDrafter

    head = load_head(path)
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


__all__ = ["HEAD_KINDS", "HeadFileError", "load_head_drafter", "new_head", "no_head_message", "shipped_head",
           "shipped_heads"]
