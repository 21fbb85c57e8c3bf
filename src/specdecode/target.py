"""Which model to load as the target, and how: the ``--model``, ``--dtype``, ``--device``, ``--linear`` and
``--weights`` flags as one frozen (picklable) value that commands and Ray replicas pass around.

It names and loads; it does not parse flags (``flags.py``) nor choose a drafter (``drafter_setup.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specdecode.models.build import LoadedModel, load_model
from specdecode.models.registry import DEFAULT_MODEL


@dataclass(frozen=True)
class TargetConfig:
    """The target model and the settings it is loaded with.

    Args:
        model: registry name, .gguf path, HF folder or hub id.
        dtype: "auto", "bfloat16", "float32" or "float16" (``models.build.load_model``).
        device: "auto", "cpu", "cuda" or "cuda:N" (``models.build.resolve_device``).
        linear: the projections' backend, a ``--linear`` name (``models.backends.LINEAR_CHOICES``).
        weights: the projections' weight format (``models.weights.WEIGHT_FORMATS``).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"
    linear: str = "auto"
    weights: str = "auto"

    def load(self, progress: Callable[[str], None] | None = None) -> LoadedModel:
        """Loads the target (fetching it first when it is not cached)."""
        return load_model(self.model, self.dtype, self.device, progress=progress, linear=self.linear,
                          weights=self.weights)
