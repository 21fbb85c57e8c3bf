"""Head files: a trained draft head's weights, its draft vocabulary, its config, the target it was trained
on and how, in one checksummed safetensors file.

Layout: tensors ``head.*`` (the head's weights) and ``vocab`` (int64 ``[V]``, every token id ranked by its
frequency in the training data: a draft vocabulary of n tokens is the first n); metadata ``format``,
``kind``, ``draft_vocab`` (the size it was trained with), ``config``, ``target``, ``recipe`` (JSON strings)
and ``sha256`` (over every tensor's name, dtype, shape and bytes). Files are written to a temporary name and
renamed, so an interrupted write never leaves a half-written head. This module does not build or run
heads (see ``eagle.py`` and ``medusa.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT = "specdecode-head/1"
KINDS = ("eagle", "medusa")


class HeadFileError(ValueError):
    """A head file that cannot be used: unreadable, corrupt, or made for another model. The message names
    the file and what is wrong."""


@dataclass
class HeadFile:
    """The contents of a head file.

    Args:
        kind: "eagle" or "medusa".
        config: the head's architecture (see ``HeadConfig``), as a JSON-able dict.
        target: the identity of the target it drafts for (``target_identity``).
        recipe: how it was trained (command, data, steps, seed, wall time), free-form.
        weights: the head's tensors, by name.
        vocab: ``[V]`` int64, token ids most frequent first (see ``vocab.frequency_ranking``).
        draft_vocab: the draft vocabulary size it was trained with (the first ids of ``vocab``; 0 = all).
    """

    kind: str
    config: dict[str, Any]
    target: dict[str, Any]
    recipe: dict[str, Any]
    weights: dict[str, torch.Tensor]
    vocab: torch.Tensor
    draft_vocab: int = 0


def target_identity(model, source: str = "") -> dict[str, Any]:
    """What a head must match in its target: shapes, and a fingerprint of the weights that is the same
    whatever dtype the model was loaded in (the first 256 embedding rows and the final norm, in bf16).

    Args:
        model: the target ``Transformer``.
        source: where it was loaded from (recorded, not compared).
    """
    c = model.config
    digest = hashlib.sha256()
    for t in (model.embed.weight[:256], model.norm):
        digest.update(t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return {"source": source, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
            "num_layers": c.num_layers, "fingerprint": digest.hexdigest()[:16]}


def check_target(path: str | Path, head_target: Mapping[str, Any], model) -> None:
    """Refuses a head trained for another model, naming the first mismatch.

    Raises:
        HeadFileError: hidden size, vocabulary size, layer count or weights differ.
    """
    have = target_identity(model)
    for key, what in (("hidden_size", "hidden size"), ("vocab_size", "vocabulary size"),
                      ("num_layers", "layer count"), ("fingerprint", "weights fingerprint")):
        if head_target.get(key) != have[key]:
            raise HeadFileError(f"{path}: head was trained for a model with {what} {head_target.get(key)} "
                                f"({head_target.get('source') or 'unnamed'}), this target has {have[key]}")


def _checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def save_head(path: str | Path, head: HeadFile) -> None:
    """Writes ``head`` to ``path`` atomically (a temporary file in the same folder, then a rename)."""
    if head.kind not in KINDS:
        raise ValueError(f"head kind {head.kind!r} is not one of {KINDS}")
    tensors = {f"head.{n}": t.detach().to("cpu").contiguous() for n, t in head.weights.items()}
    tensors["vocab"] = head.vocab.to("cpu", torch.int64).contiguous()
    meta = {"format": FORMAT, "kind": head.kind, "draft_vocab": str(head.draft_vocab), "config": json.dumps(head.config),
            "target": json.dumps(head.target), "recipe": json.dumps(head.recipe), "sha256": _checksum(tensors)}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Calls ``write(tmp)`` on a temporary file beside ``path``, then renames it to ``path``: an interrupt
    leaves ``path`` as it was and no temporary file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as a plain open() would create it, not mkstemp's 0600
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_metadata(path: str | Path) -> dict[str, str]:
    """The file's metadata without loading the tensors."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        raise HeadFileError(f"{path}: not a readable head file ({err})") from None


def load_head(path: str | Path) -> HeadFile:
    """Reads and checks a head file.

    Raises:
        HeadFileError: missing, truncated or corrupt file, another format, or a checksum mismatch.
    """
    path = Path(path)
    if not path.is_file():
        raise HeadFileError(f"{path}: no such head file")
    meta = read_metadata(path)
    if meta.get("format") != FORMAT:
        raise HeadFileError(f"{path}: not a specdecode head file (format {meta.get('format')!r}, expected {FORMAT!r})")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise HeadFileError(f"{path}: corrupt head file ({err})") from None
    if _checksum(tensors) != meta.get("sha256"):
        raise HeadFileError(f"{path}: checksum mismatch (the file was changed or damaged after it was written)")
    if "vocab" not in tensors or meta.get("kind") not in KINDS:
        raise HeadFileError(f"{path}: head file lacks its draft vocabulary or kind")
    try:
        config, target, recipe = (json.loads(meta[k]) for k in ("config", "target", "recipe"))
        draft_vocab = int(meta.get("draft_vocab", "0"))
    except (KeyError, ValueError) as err:
        raise HeadFileError(f"{path}: unreadable metadata ({err})") from None
    weights = {n.removeprefix("head."): t for n, t in tensors.items() if n.startswith("head.")}
    return HeadFile(meta["kind"], config, target, recipe, weights, tensors["vocab"], draft_vocab)
