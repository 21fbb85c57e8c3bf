"""Where layer-skip sets come from: shipped defaults, stored calibrations, or a calibration run now.

Stores results as small JSON files under the model cache directory; it does not search (see
``drafters/layer_skip.calibrate_skip_set``). It sits beside the command line rather than among the
drafters because it knows loaded models and where they are cached; the drafter itself takes a skip set.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Callable

from specdecode.drafters.layer_skip import Calibration, calibrate_skip_set, parse_layers
from specdecode.models.build import LoadedModel
from specdecode.models.fetch import cache_dir

# Short prompts of different kinds: a skip set tuned on one kind of text overfits it.
CALIBRATION_PROMPTS = (
    "Summarise in two sentences: The city council met on Tuesday to discuss the new bus routes. Residents "
    "complained that the current timetable leaves the northern districts without service after 9 pm.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "What is the capital of Australia, and why was it chosen over Sydney and Melbourne?",
    "Translate into French: The weather is lovely today, so we are going to the beach.",
)


def _store(model: LoadedModel, dtype: str) -> Path:
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{model.source}-{dtype}")[-120:]
    return cache_dir() / "layerskip" / f"{key}.json"


def find_skip_set(model: LoadedModel, dtype: str) -> tuple[int, ...] | None:
    """The stored calibration for this model and dtype, or None."""
    path = _store(model, dtype)
    try:
        skip = tuple(json.loads(path.read_text())["skip"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    n = model.model.config.num_layers
    return skip if skip and all(isinstance(i, int) and 0 <= i < n for i in skip) and len(skip) < n else None


def calibrate_and_store(model: LoadedModel, dtype: str, gamma: int = 4, new_tokens: int = 48,
                        progress: Callable[[str], None] | None = None) -> Calibration:
    """Runs the skip-set search on CALIBRATION_PROMPTS (chat-formatted when the model has a template) and stores it."""
    tok = model.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if tok.chat_template else p
             for p in CALIBRATION_PROMPTS]
    if progress:
        progress(f"calibrating layer skipping on {len(texts)} prompts (a minute or two) ...")
    result = calibrate_skip_set(model.model, [tok.encode_prompt(t) for t in texts], new_tokens=new_tokens, gamma=gamma,
                                progress=progress)
    path = _store(model, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temp file and rename, so an interrupted run never leaves a half-written file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"skip": list(result.skip), "agreement": result.agreement,
                   "predicted_speedup": result.predicted_speedup, "gamma": result.gamma}, f)
    os.replace(tmp, path)
    return result


def resolve_skip_set(model: LoadedModel, dtype: str, spec: str,
                     progress: Callable[[str], None] | None = None) -> tuple[int, ...]:
    """The skip set a ``--skip-layers`` value names: a layer list, or "auto" (stored calibration, else a new one)."""
    if spec != "auto":
        return parse_layers(spec, model.model.config.num_layers)
    found = find_skip_set(model, dtype)
    if found:
        if progress:
            progress(f"layerskip: stored skip set {','.join(map(str, found))}")
        return found
    return calibrate_and_store(model, dtype, progress=progress).skip
