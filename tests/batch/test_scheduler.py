"""Scheduler, slot pool and row budget, without a model."""

from __future__ import annotations

import pytest

from specdecode.batch.scheduler import QueueFullError, Scheduler, SchedulerConfig, SlotPool
from specdecode.batch.sequence import Request, SequenceState


def _seq() -> SequenceState:
    return SequenceState(Request((1, 2, 3)))


def test_admission_is_first_come_first_served_onto_free_slots():
    sched = Scheduler(SchedulerConfig(max_running=2, max_waiting=2))
    seqs = [_seq() for _ in range(4)]
    for s in seqs:
        sched.add(s)
    assert sched.admit() == seqs[:2] and [s.slot for s in seqs[:2]] == [0, 1]
    assert list(sched.waiting) == seqs[2:] and sched.admit() == []
    sched.remove(seqs[0])
    assert seqs[0].slot is None and sched.admit() == [seqs[2]] and seqs[2].slot == 0  # the freed slot is reused


def test_full_queue_refuses_with_a_clear_error():
    sched = Scheduler(SchedulerConfig(max_running=1, max_waiting=1))
    sched.add(_seq())  # takes the free slot at the next admit
    sched.add(_seq())  # waits
    with pytest.raises(QueueFullError, match=r"queue is full: 2 waiting \(max_waiting 1\), 0 running"):
        sched.add(_seq())
    assert len(sched.waiting) == 2


def test_removing_a_waiting_sequence_and_has_work():
    sched = Scheduler(SchedulerConfig(max_running=1))
    a, b = _seq(), _seq()
    sched.add(a)
    sched.add(b)
    sched.admit()
    sched.remove(b)
    assert list(sched.waiting) == [] and sched.has_work
    sched.remove(a)
    assert not sched.has_work and sched.slots.free == 1


def test_slot_pool_refuses_double_release_and_exhaustion():
    pool = SlotPool(2)
    a, b = pool.acquire(), pool.acquire()
    with pytest.raises(RuntimeError, match="no free KV slot"):
        pool.acquire()
    pool.release(a)
    with pytest.raises(RuntimeError, match="is not held"):
        pool.release(a)
    with pytest.raises(RuntimeError, match="is not held"):
        pool.release(7)
    assert pool.free == 1 and b == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_running=0), "max_running must be >= 1"),
    (dict(max_waiting=-1), "max_waiting must be >= 0"),
    (dict(max_running=8, max_rows=8), r"max_rows \(8\) must be > max_running \(8\)"),
    (dict(prefill_chunk=0), "prefill_chunk must be >= 1"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)
