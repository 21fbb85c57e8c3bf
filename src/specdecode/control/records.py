"""Step records as JSON lines: what ``specdecode bench --record-steps`` writes and ``fit-controller`` reads.

One line per decode step of one request:

    {"version": 1, "model", "method", "drafter", "prompt_id", "category", "repeat", "step",
     "requested", "drafted", "accepted", "draft_s", "verify_s",
     "remaining", "context_len", "max_context", "cache_fill", "kv",
     "signal_names": [...], "signals": [[...] per drafted token]}

It converts and checks; it does not fit (see ``fit.py``) and does not run anything.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

from specdecode.control.base import StepContext, StepRecord

RECORD_VERSION = 1
_NUMBERS = ("requested", "drafted", "accepted", "draft_s", "verify_s", "remaining", "context_len", "max_context")


class RecordError(ValueError):
    """A step-record file is unreadable or has a malformed line."""


def record_json(record: StepRecord, signal_names: Sequence[str], **meta: Any) -> dict[str, Any]:
    """One JSON line for ``record``; ``meta`` names the model, method, drafter, prompt and step."""
    c = record.ctx
    return {"version": RECORD_VERSION, **meta, "requested": record.requested, "drafted": record.drafted,
            "accepted": record.accepted, "draft_s": record.draft_s, "verify_s": record.verify_s,
            "remaining": c.remaining, "context_len": c.context_len, "max_context": c.max_context,
            "cache_fill": c.cache_fill, "kv": c.kv, "signal_names": list(signal_names),
            "signals": [list(s) for s in record.signals]}


def _check(line: dict[str, Any]) -> str | None:
    """Why a parsed line is not a usable record, or None."""
    if line.get("version") != RECORD_VERSION:
        return f"version {line.get('version')!r}, expected {RECORD_VERSION}"
    for key in ("model", "drafter", "kv"):
        if not isinstance(line.get(key), str):
            return f"{key!r} must be a string"
    for key in _NUMBERS:
        v = line.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            return f"{key!r} must be a number >= 0, got {v!r}"
    if line["accepted"] > line["drafted"] or line["max_context"] < 1:
        return "accepted exceeds drafted, or max_context < 1"
    fill = line.get("cache_fill")
    if fill is not None and (isinstance(fill, bool) or not isinstance(fill, (int, float)) or not 0 <= fill <= 1):
        return f"'cache_fill' must be null or a number in 0..1, got {fill!r}"
    names, signals = line.get("signal_names"), line.get("signals")
    if not isinstance(names, list) or not isinstance(signals, list):
        return "'signal_names' and 'signals' must be lists"
    if signals and len(signals) != line["drafted"]:
        return f"{len(signals)} signals for {line['drafted']} drafted tokens"
    for s in signals:
        if not isinstance(s, list) or len(s) != len(names) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in s):
            return f"a signal {s!r} is not {len(names)} finite numbers"
    return None


def read_records(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Every record of the JSONL files, checked; blank lines are skipped.

    Raises:
        RecordError: naming ``FILE:LINE`` and the reason, for the first bad line.
    """
    out = []
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise RecordError(f"cannot read step records {path}: {exc}") from None
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
            except ValueError as exc:
                raise RecordError(f"{path}:{number}: not JSON ({exc})") from None
            why = _check(line) if isinstance(line, dict) else "not a JSON object"
            if why:
                raise RecordError(f"{path}:{number}: {why}")
            out.append(line)
    return out


def step_record(line: dict[str, Any]) -> StepRecord:
    """The :class:`StepRecord` a checked line describes."""
    ctx = StepContext(remaining=int(line["remaining"]), context_len=int(line["context_len"]),
                      max_context=int(line["max_context"]), cache_fill=line["cache_fill"], kv=line["kv"])
    return StepRecord(ctx=ctx, requested=int(line["requested"]), drafted=int(line["drafted"]),
                      accepted=int(line["accepted"]), draft_s=line["draft_s"], verify_s=line["verify_s"],
                      signals=[tuple(float(x) for x in s) for s in line["signals"]])
