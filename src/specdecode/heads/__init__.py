"""Trained draft heads on the target's own features: EAGLE-style (``eagle.py``) and Medusa-style
(``medusa.py``), their file format (``file.py``), draft vocabulary (``vocab.py``), training data
(``data.py``) and training (``train.py``).

This module builds a head of either kind and finds the heads that ship with the package (``data/``, for
the registry's SmolLM2), by the target's weights fingerprint. It does not draft: a head file becomes a
drafter in ``drafters/head_loader.py``.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from torch import nn

from specdecode.heads.eagle import EagleConfig, EagleHead
from specdecode.heads.file import HeadFileError, read_metadata, target_identity
from specdecode.heads.medusa import MedusaConfig, MedusaHeads

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


__all__ = ["HEAD_KINDS", "HeadFileError", "new_head", "no_head_message", "shipped_head", "shipped_heads"]
