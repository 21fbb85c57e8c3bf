"""What a forward costs: row padding for kernels whose speed jumps with the row count, the plain decode step's
seconds by context length (a request's ``decode_step_s``), and the timed forwards that measure both.

:class:`StepTimer` times forwards as a step runs them (padding included) in a slot it rolls back afterwards, so
that a timing changes nothing; at warm-up it tunes the padding off our kernels and seeds cost-aware controllers
with a verification cost curve, which ``remembered_curve`` keeps on disk, so a later start of the same model
shape on the same machine does not time it again. It does not decide drafts or run decode steps.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from specdecode.batch.scheduler import SlotPool
from specdecode.batch.target_kv import TargetKV
from specdecode.control import ControllerFactory
from specdecode.models.fetch import cache_dir
from specdecode.models.native import cpu_model, source_digest
from specdecode.models.prefill import prefill
from specdecode.models.rows import LogitRows
from specdecode.models.transformer import Transformer
from specdecode.sampling import argmax_ids
from specdecode.timing import interleaved_timings

# Row counts tried when tuning a forward's padding.
MAX_PADDED_ROWS = 8
SEEDED_ROWS = 17  # longest forward timed for the cost curve (a fed token + 16 drafts); longer ones extrapolated
# On our kernels a forward's cost only grows with its rows: a size timed this much above a larger one was disturbed
# (seen: 4 rows remembered at 6.2 ms beside 5 rows at 3.4), and is timed again, at most CURVE_RETRIES times.
CURVE_SLACK, CURVE_RETRIES = 0.1, 2
WARMUP_CONTEXT = 64  # tokens of context the warm-up timings run at: projections, which grow with rows, dominate


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


def remembered_curve(what: dict[str, Any], sizes: Sequence[int], measure: Callable[[Sequence[int]], list[float]],
                     folder: Path, tolerance: float = 0.2) -> list[float]:
    """A cost curve (seconds per size of ``sizes``) measured on an earlier start for the same ``what`` (everything
    the cost depends on: the model's shape and weight formats, the backend, threads, CPU, the sizes timed), else
    ``measure(sizes)`` now and remembered as ``folder/<hash of what>.json``. Costs depend on no weight value, so
    models of one shape share a curve; delete the folder to measure again.

    A remembered curve is checked at each start: its first and last sizes are timed again, and a curve that was
    timed while something else held the cores (either size now more than ``tolerance`` faster than remembered) is
    measured again and replaced. A machine busier now than then keeps the remembered curve: noise only adds time.
    A curve where a size costs more than a larger one (beyond CURVE_SLACK) is timed again, the fastest of the
    timings kept per size, when measured and, remembered so, at the next start.
    """
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]
    path = folder / f"{key}.json"
    saved = _saved_curve(path, what, len(sizes))
    if saved is not None and rising(saved):
        ends = [sizes[0], sizes[-1]]
        if all(now >= then * (1 - tolerance) for now, then in zip(measure(ends), (saved[0], saved[-1]))):
            return saved
    seconds = measure(sizes)
    for _ in range(CURVE_RETRIES):
        if rising(seconds):
            break
        seconds = fastest(zip(seconds, measure(sizes)))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"what": what, "seconds": seconds}, default=str))
        os.replace(tmp, path)
    except OSError:  # only an optimization: measured again next time
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return seconds


def rising(seconds: Sequence[float], slack: float = CURVE_SLACK) -> bool:
    """Whether no size's time is more than ``slack`` above a larger size's (sizes in increasing order)."""
    floor = float("inf")
    for s in reversed(seconds):
        if s > floor * (1 + slack):
            return False
        floor = min(floor, s)
    return True


def _saved_curve(path: Path, what: dict[str, Any], sizes: int) -> list[float] | None:
    """The curve saved at ``path`` for ``what``; None when there is none, or it is for something else or broken."""
    try:
        saved = json.loads(path.read_text())
        if saved.get("what") == json.loads(json.dumps(what, default=str)) and len(saved.get("seconds", ())) \
                == sizes and all(isinstance(x, float) and x > 0 for x in saved["seconds"]):
            return saved["seconds"]
    except (OSError, ValueError, AttributeError):
        pass
    return None


@dataclass(kw_only=True)
class StepTimer:
    """Times the target's forwards as a step runs them, each rolled back so that it changes nothing.

    Args:
        target: the model timed.
        kv: its cache over the engine's slots.
        padding: the row padding a step applies (tuned here at warm-up off our kernels).
        step_costs: the plain step's cost by context length.
    """

    target: Transformer
    kv: TargetKV
    padding: RowPadding
    step_costs: StepCostTable = field(default_factory=StepCostTable)

    def time_rows(self, slot: int, rows: int, pad: bool = True) -> float:
        """Seconds of a forward of ``rows`` rows in ``slot`` (padded as a step pads it) with the logits a step
        reads and their greedy picks, rolled back afterwards."""
        cache, held = self.kv.cache, self.kv.cache.lengths[slot]
        n = self.padding.rows(rows, self.kv.room(slot)) if pad else rows
        tokens = torch.zeros(n, dtype=torch.long, device=self.target.device)
        start = time.perf_counter()
        out = self.target.forward_rows(tokens, cache, (slot,), (n,), logits=LogitRows.at(torch.arange(rows)))
        argmax_ids(out.logits)
        self.target.synchronize()
        seconds = time.perf_counter() - start
        cache.trim(slot, held)
        return seconds

    def plain_step_s(self, slot: int, context: int) -> float:
        """A plain decode step's seconds at ``context`` tokens (timed in ``slot`` the first time a bucket is met)."""
        return self.step_costs.at(context, lambda: self.time_rows(slot, 1))

    @contextlib.contextmanager
    def borrowed_slot(self, context: Sequence[int], slots: SlotPool, busy: bool) -> Iterator[int]:
        """A free slot holding ``context`` (prefilled) while the block runs, emptied and given back after it."""
        if len(context) + SEEDED_ROWS + MAX_PADDED_ROWS > self.kv.config.max_len:
            self.kv.grow_for(len(context) + SEEDED_ROWS, busy)
        slot = slots.acquire()
        cache = self.kv.cache
        try:
            cache.reset(slot)
            prefill(cache, slot, list(context), self.target, invariant_rows=self.target.backend.row_invariant)
            yield slot
        finally:
            cache.reset(slot)
            slots.release(slot)

    def calibrate(self, slot: int, controllers: ControllerFactory, max_rows: int, repeats: int) -> None:
        """The warm-up's timings in ``slot`` (holding WARMUP_CONTEXT tokens): off our kernels the padding is tuned
        (on ours cost only grows with the rows, and tuning picks noise); the plain step's cost there; and, for
        cost-aware controllers, a forward's cost by its rows, 1 to ``max_rows`` (at most SEEDED_ROWS; the fastest
        of ``repeats`` interleaved timings per size; on row-invariant backends remembered on disk)."""
        invariant = self.target.backend.row_invariant
        if not invariant:
            self.padding.tune(lambda rows: self.time_rows(slot, rows, pad=False), repeats)
            self.step_costs.clear()  # measured with the old padding
        self.plain_step_s(slot, WARMUP_CONTEXT)
        if not controllers.uses_costs:
            return
        sizes = range(1, min(max_rows, SEEDED_ROWS) + 1)

        def measure(rows: Sequence[int]) -> list[float]:
            return fastest(interleaved_timings(lambda n: self.time_rows(slot, n), rows, repeats))

        # elsewhere the padding just tuned is part of the cost: measured at every start
        curve = remembered_curve(self.setting(sizes, repeats), sizes, measure, cache_dir() / "costs") if invariant \
            else measure(sizes)
        controllers.seed_costs(curve)

    def setting(self, sizes: range, repeats: int) -> dict[str, object]:
        """Everything a forward's cost depends on (no weight value does): the key of a remembered curve."""
        t = self.target
        return {"config": t.config, "weights": t.weight_format, "backend": t.backend.name, "dtype": t.dtype,
                "device": t.device, "fused": t.runner.fused, "torch": torch.__version__,
                "threads": torch.get_num_threads(), "cpu": cpu_model(), "kernels": source_digest(),
                "cache": self.kv.config, "context": WARMUP_CONTEXT, "sizes": list(sizes), "repeats": repeats}
