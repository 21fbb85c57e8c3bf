"""What a batch engine tells the code around it, from the thread that steps it: admissions, every step's
record, finished sequences. Not here: metrics themselves (``serve/metrics.py``) or records' storage."""

from __future__ import annotations

from typing import Callable, Protocol

from specdecode.batch.sequence import SequenceState
from specdecode.control import StepRecord


class StepObserver(Protocol):
    """Told what the engine does (e.g. ``serve/metrics.py``)."""

    def admitted(self, seq: SequenceState) -> None:
        """A sequence got a slot and its prompt was prefilled."""

    def stepped(self, seq: SequenceState, record: StepRecord, emitted: int, now: float) -> None:
        """A sequence's step: its record, the tokens it kept, and when."""

    def finished(self, seq: SequenceState) -> None:
        """A sequence ended (any reason, cancellation included) and left its slot."""


class RecordObserver:
    """Hands every step's record to ``on_step`` (e.g. ``bench --record-steps``)."""

    def __init__(self, on_step: Callable[[StepRecord], None]) -> None:
        self.on_step = on_step

    def admitted(self, seq: SequenceState) -> None:
        pass

    def stepped(self, seq: SequenceState, record: StepRecord, emitted: int, now: float) -> None:
        self.on_step(record)

    def finished(self, seq: SequenceState) -> None:
        pass
