"""The acceptance model of the ``confidence`` and ``adaptive`` controllers, and its JSON file.

A logistic model predicts, from the draft's own signals for one token (e.g. top-1 probability and
entropy), its position and the KV compression setting, the chance that the target accepts that token
given that it accepts the tokens before it. One model per drafter, in one file:

    {"format": "specdecode-controller", "schema_version": 1,
     "entries": {DRAFTER: {"features": [...], "weights": [...], "bias": b, "models": [...],
                           "fitted_on_drafter": DRAFTER, "samples": n, "validation": {...}}},
     "checksum": "sha256:<hex of the canonical JSON of format, schema_version and entries>"}

Loading checks everything (JSON, format, version, checksum, numbers, the feature set) and fails with
an error that names the file and the problem. This module does not fit models (see ``fit.py``).

Memory pressure is not a model input: the recorded contexts span too narrow a range to fit it (a fit
learns the prompts' lengths, and extrapolates wildly); it acts through ``base.memory_cap`` instead.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from specdecode.control.base import Signal, StepContext

FORMAT = "specdecode-controller"
SCHEMA_VERSION = 1
DEFAULT_FILE = Path(__file__).parent / "data" / "default.json"
# Context features of every model, after the drafter's own signals.
CONTEXT_FEATURES = ("position", "kv_int8", "kv_int4", "kv_window")


class ControllerFileError(ValueError):
    """A controller file is unreadable, damaged, of another version, or fitted for other features."""


def feature_names(signal_names: Sequence[str]) -> tuple[str, ...]:
    """The model's inputs for a drafter whose signals are ``signal_names``."""
    return (*signal_names, *CONTEXT_FEATURES)


def feature_row(signal: Signal, position: int, ctx: StepContext) -> list[float]:
    """The inputs for the draft token at ``position`` (0-based), in :func:`feature_names` order."""
    kv = ctx.kv
    return [*signal, position + 1.0, float(kv == "int8"), float(kv == "int4"), float(kv == "window")]


def sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


@dataclass
class AcceptanceModel:
    """A fitted logistic model for one drafter.

    Args:
        drafter: the drafter it serves (``Drafter.name``).
        features: input names (see :func:`feature_names`).
        weights: one per feature.
        bias: the intercept.
        models: target model(s) whose step records it was fitted on.
        fitted_on_drafter: the drafter whose records it was fitted on (another one with the same signals
            when it stands in, e.g. layerskip's fit for the draft model).
        samples: judged draft tokens it was fitted on.
        validation: held-out figures (log_loss, accuracy, base_rate, samples).
    """

    drafter: str
    features: tuple[str, ...]
    weights: tuple[float, ...]
    bias: float
    models: tuple[str, ...] = ()
    fitted_on_drafter: str = ""
    samples: int = 0
    validation: dict[str, float] = field(default_factory=dict)

    def logit(self, row: Sequence[float]) -> float:
        """The log-odds of acceptance for one :func:`feature_row`."""
        return self.bias + sum(w * x for w, x in zip(self.weights, row))

    def predict(self, row: Sequence[float]) -> float:
        """P(accepted | earlier tokens accepted) for one :func:`feature_row`."""
        return sigmoid(self.logit(row))

    def to_json(self) -> dict[str, Any]:
        return {"features": list(self.features), "weights": list(self.weights), "bias": self.bias,
                "models": list(self.models), "fitted_on_drafter": self.fitted_on_drafter or self.drafter,
                "samples": self.samples, "validation": dict(self.validation)}


@dataclass
class ControllerFile:
    """Acceptance models by drafter name, and where they came from."""

    entries: dict[str, AcceptanceModel]
    path: str = "<memory>"

    def model_for(self, drafter: str, signal_names: Sequence[str]) -> AcceptanceModel:
        """The model for ``drafter``, checked against the signals it gives.

        Raises:
            ControllerFileError: no model for that drafter, or one fitted on other features.
        """
        if drafter not in self.entries:
            raise ControllerFileError(
                f"controller file {self.path} has no model for drafter {drafter!r} (it has: "
                f"{', '.join(sorted(self.entries)) or 'none'}); record steps with `specdecode bench --record-steps` "
                f"and fit one with `specdecode fit-controller`")
        model = self.entries[drafter]
        want = feature_names(signal_names)
        if model.features != want:
            raise ControllerFileError(
                f"controller file {self.path}: the {drafter!r} model was fitted on features {list(model.features)}, "
                f"but this version's {drafter} drafter gives {list(want)}; refit it with `specdecode fit-controller`")
        return model


def _payload(entries: dict[str, AcceptanceModel]) -> dict[str, Any]:
    return {"format": FORMAT, "schema_version": SCHEMA_VERSION,
            "entries": {name: m.to_json() for name, m in sorted(entries.items())}}


def checksum(payload: dict[str, Any]) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def save_controller_file(entries: dict[str, AcceptanceModel], path: str | Path) -> None:
    """Writes the models with their checksum (the file is replaced only once fully written)."""
    payload = _payload(entries)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**payload, "checksum": checksum(payload)}, indent=1) + "\n")
    tmp.replace(path)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ControllerFileError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _entry(name: str, raw: Any, where: str) -> AcceptanceModel:
    where = f"{where}: entry {name!r}"
    if not isinstance(raw, dict):
        raise ControllerFileError(f"{where} is not an object")
    missing = [k for k in ("features", "weights", "bias") if k not in raw]
    if missing:
        raise ControllerFileError(f"{where} lacks {', '.join(missing)}")
    features, weights = raw["features"], raw["weights"]
    if not isinstance(features, list) or not features or not all(isinstance(f, str) for f in features):
        raise ControllerFileError(f"{where}: features must be a non-empty list of names")
    if tuple(features[-len(CONTEXT_FEATURES):]) != CONTEXT_FEATURES:
        raise ControllerFileError(f"{where}: features {features} do not end with this version's context features "
                                  f"{list(CONTEXT_FEATURES)}; refit it with `specdecode fit-controller`")
    if not isinstance(weights, list) or len(weights) != len(features):
        raise ControllerFileError(f"{where}: {len(weights) if isinstance(weights, list) else 'no'} weights "
                                  f"for {len(features)} features")
    return AcceptanceModel(
        drafter=name, features=tuple(features),
        weights=tuple(_number(w, f"{where}: weight of {f!r}") for w, f in zip(weights, features)),
        bias=_number(raw["bias"], f"{where}: bias"), models=tuple(str(m) for m in raw.get("models", ())),
        fitted_on_drafter=str(raw.get("fitted_on_drafter", name)), samples=int(raw.get("samples", 0)),
        validation={str(k): v for k, v in dict(raw.get("validation", {})).items()})


def load_controller_file(path: str | Path | None = None) -> ControllerFile:
    """Reads and validates a controller file (None: the one shipped with the package).

    Raises:
        ControllerFileError: unreadable, not JSON (e.g. truncated), another format or schema version,
            a checksum that does not match (damaged or edited), or malformed entries.
    """
    path = Path(path) if path is not None else DEFAULT_FILE
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ControllerFileError(f"cannot read controller file {path}: {exc}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ControllerFileError(f"controller file {path} is not valid JSON (truncated or corrupt?): {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ControllerFileError(f"{path} is not a specdecode controller file (no \"format\": \"{FORMAT}\")")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ControllerFileError(f"controller file {path} has schema version {doc.get('schema_version')!r}; this "
                                  f"specdecode reads version {SCHEMA_VERSION}: refit it with `specdecode fit-controller`")
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        raise ControllerFileError(f"controller file {path} has no \"entries\" object")
    payload = {"format": doc["format"], "schema_version": doc["schema_version"], "entries": entries}
    try:
        expected = checksum(payload)
    except ValueError as exc:  # NaN or infinity in the numbers
        raise ControllerFileError(f"controller file {path} holds a non-finite number: {exc}") from None
    if doc.get("checksum") != expected:
        raise ControllerFileError(f"controller file {path}: checksum mismatch (file says {doc.get('checksum')!r}, "
                                  f"contents give {expected!r}): it was damaged or edited by hand")
    return ControllerFile({name: _entry(name, raw, f"controller file {path}") for name, raw in entries.items()},
                          str(path))
