"""What a forward costs: row padding for kernels whose speed jumps with the row count, and the plain
decode step's seconds by context length (a request's ``decode_step_s``).

Both are measured by the engine (``executor.py``) with forwards that it rolls back; this module keeps
the tables and picks from them, and remembers a measured verification cost curve on disk
(``remembered_curve``), so a later start of the same model shape on the same machine does not time it again.
It does not run models itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from specdecode.timing import interleaved_timings

# Row counts tried when tuning a forward's padding.
MAX_PADDED_ROWS = 8


@dataclass
class RowPadding:
    """Rows needed -> rows run. Off our kernels a one-row forward rounds differently from a multi-row one
    (``Backend.row_invariant``), so every forward runs at least ``min_rows``; oneDNN's bf16 kernels
    also pick their algorithm by row count, and some counts run slower than larger ones (2 rows cost 1.5x
    what 4 rows cost on Qwen2.5-1.5B), so ``tune`` may pad further.

    Args:
        min_rows: the fewest rows a forward runs (1 on our kernels, 2 elsewhere).
    """

    min_rows: int = 1
    table: dict[int, int] = field(default_factory=dict)

    def rows(self, need: int, room: int) -> int:
        """Rows to run for ``need`` real rows when the last sequence's slot has ``room`` rows to spare."""
        return max(min(self.table.get(need, self.min_rows), room), need, self.min_rows)

    def tune(self, cost: Callable[[int], float], repeats: int, margin: float = 0.03) -> dict[int, int]:
        """Times forwards of ``min_rows``..MAX_PADDED_ROWS rows (``cost(rows)`` -> seconds, interleaved
        ``repeats`` times, medians compared) and pads each need to the fastest count at or above it; a
        larger count is taken only when it is ``margin`` faster. Returns the table."""
        sizes = range(self.min_rows, MAX_PADDED_ROWS + 1)
        median = {r: statistics.median(t) for r, t in zip(sizes, interleaved_timings(cost, sizes, repeats))}
        table = {}
        for need in range(1, MAX_PADDED_ROWS + 1):
            best = max(need, self.min_rows)
            for r in range(best + 1, MAX_PADDED_ROWS + 1):
                if median[r] < median[best] * (1 - margin):
                    best = r
            table[need] = best
        self.table = table
        return table


@dataclass
class StepCostTable:
    """Seconds of one plain decode step (a median of ``repeats`` timings) per power-of-two context length,
    since attention cost grows with the context; each bucket is timed once, when a request first ends
    there, and kept."""

    repeats: int = 3
    seconds: dict[int, float] = field(default_factory=dict)

    def at(self, context: int, time_step: Callable[[], float]) -> float:
        """The step cost at ``context`` tokens; ``time_step()`` times one step when the bucket is new."""
        bucket = context.bit_length()
        if bucket not in self.seconds:
            self.seconds[bucket] = statistics.median(time_step() for _ in range(self.repeats))
        return self.seconds[bucket]

    def clear(self) -> None:
        """Forgets every bucket (after the padding changed, steps cost something else)."""
        self.seconds.clear()


def fastest(times: Sequence[Sequence[float]]) -> list[float]:
    """Each entry's fastest time: noise only ever adds time, and one slow sample would otherwise price a
    draft length out of a cost curve."""
    return [min(t) for t in times]


def remembered_curve(what: dict[str, Any], measure: Callable[[], list[float]], folder: Path) -> list[float]:
    """A cost curve (seconds per size) measured on an earlier start for the same ``what`` (everything the cost
    depends on: the model's shape and weight formats, the backend, threads, CPU, the sizes timed), else
    ``measure()`` now and remembered as ``folder/<hash of what>.json``. Costs depend on no weight value, so
    models of one shape share a curve; delete the folder to measure again."""
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]
    path = folder / f"{key}.json"
    try:
        saved = json.loads(path.read_text())
        if saved.get("what") == json.loads(json.dumps(what, default=str)) and len(saved.get("seconds", ())) \
                == len(what.get("sizes", ())) and all(isinstance(x, float) and x > 0 for x in saved["seconds"]):
            return saved["seconds"]
    except (OSError, ValueError, AttributeError):
        pass
    seconds = measure()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"what": what, "seconds": seconds}, default=str))
        os.replace(tmp, path)
    except OSError:  # only an optimization: measured again next time
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return seconds
