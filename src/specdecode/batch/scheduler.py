"""Which sequences run in the next step: admission from a bounded waiting queue onto free KV slots.

First come, first served: a waiting sequence starts as soon as a slot is free (at most ``max_running``
at once), and a full waiting queue refuses new requests (:class:`QueueFullError`) instead of growing
without bound. Slots come from :class:`SlotPool`, one cache slot per running sequence, returned when
the sequence finishes or is cancelled.

It does not run models or know what a slot holds (``executor.py``); it never preempts a running sequence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specdecode.batch.sequence import SequenceState


class QueueFullError(RuntimeError):
    """The waiting queue is full; the request was not queued (retry later)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """How many sequences are served at once.

    Args:
        max_running: sequences decoded together (each holds one KV slot of ``max_len`` tokens).
        max_waiting: requests queued beyond those; one more is refused with :class:`QueueFullError`.
        max_rows: rows one target forward may hold while some sequence decodes: each decoding sequence's
            fed token, then prompt rows of sequences still prefilling, then drafts (shortened, longest first,
            to fit). On a CPU a forward's cost grows with its rows, so this bounds the time between tokens.
            None: twice ``max_running``.
        prefill_chunk: prompt rows per forward while no sequence decodes (nobody waits between tokens).
    """

    max_running: int = 4
    max_waiting: int = 64
    max_rows: int | None = None
    prefill_chunk: int = 256

    def __post_init__(self) -> None:
        if self.max_rows is None:
            object.__setattr__(self, "max_rows", 2 * self.max_running)
        if self.max_running < 1:
            raise ValueError(f"SchedulerConfig.max_running must be >= 1, got {self.max_running}")
        if self.max_waiting < 0:
            raise ValueError(f"SchedulerConfig.max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_rows <= self.max_running:
            raise ValueError(f"SchedulerConfig.max_rows ({self.max_rows}) must be > max_running ({self.max_running}): "
                             "every decoding sequence needs a row per step, and prompts at least one more")
        if self.prefill_chunk < 1:
            raise ValueError(f"SchedulerConfig.prefill_chunk must be >= 1, got {self.prefill_chunk}")


class SlotPool:
    """The free slots of a cache with ``size`` slots."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = list(range(size - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV slot")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.size or slot in self._free:
            raise RuntimeError(f"slot {slot} is not held (pool of {self.size}, free {sorted(self._free)})")
        self._free.append(slot)


class Scheduler:
    """The waiting queue and the running set.

    Args:
        config: limits.
    """

    def __init__(self, config: SchedulerConfig = SchedulerConfig()) -> None:
        self.config = config
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self.slots = SlotPool(config.max_running)

    def add(self, seq: SequenceState) -> None:
        """Queues a sequence; raises :class:`QueueFullError` when the queue is full."""
        if not self.can_accept:
            raise QueueFullError(f"the request queue is full: {len(self.waiting)} waiting (max_waiting "
                                 f"{self.config.max_waiting}), {len(self.running)} running (max_running "
                                 f"{self.config.max_running}); retry later")
        self.waiting.append(seq)

    @property
    def can_accept(self) -> bool:
        """Whether :meth:`add` would queue one more (free slots take waiting sequences at the next step)."""
        return len(self.waiting) < self.config.max_waiting + self.slots.free

    def admit(self) -> list[SequenceState]:
        """Moves waiting sequences onto free slots (oldest first); returns the newly running ones."""
        admitted = []
        while self.waiting and self.slots.free:
            seq = self.waiting.popleft()
            seq.slot = self.slots.acquire()
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def remove(self, seq: SequenceState) -> None:
        """Takes a finished or cancelled sequence out, returning its slot."""
        if seq in self.running:
            self.running.remove(seq)
            self.slots.release(seq.slot)
            seq.slot = None
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

