"""LongDrafts (control/long.py): long draft sources run past the wrapped controller's bound, doubling while
every drafted token is kept, and a loss sets the next draft to the run that ended; without a long run the
wrapped controller decides and learns alone."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.control.base import FixedGamma, StepContext, StepRecord
from specdecode.control.long import LONG_START, LongDrafts

CTX = StepContext(remaining=500, context_len=100, max_context=4096)


@dataclass
class Source:
    """A drafter whose long run is set by the test."""

    run: int = 0

    def long_run(self) -> int:
        return self.run


@dataclass
class Recording(FixedGamma):
    records: list[StepRecord] = field(default_factory=list)

    def update(self, record: StepRecord) -> None:
        self.records.append(record)


def _step(controller: LongDrafts, accepted: int | None = None) -> int:
    """One step: the gamma asked for, then a record with ``accepted`` of it kept (all when None)."""
    k = controller.next_gamma(CTX)
    controller.update(StepRecord(ctx=CTX, requested=k, drafted=k, accepted=k if accepted is None else accepted,
                                 draft_s=0.0, verify_s=0.0))
    return k


def test_without_a_long_run_the_wrapped_controller_decides_and_learns():
    inner = Recording(3)
    controller = LongDrafts(inner, Source(0), long_max=64)
    assert [_step(controller) for _ in range(3)] == [3, 3, 3] and len(inner.records) == 3
    assert controller.early_stop is False


def test_long_drafts_double_while_kept_whole_up_to_the_bounds():
    inner, source = Recording(3), Source(1000)
    controller = LongDrafts(inner, source, long_max=64)
    assert [_step(controller) for _ in range(6)] == [LONG_START, 8, 16, 32, 64, 64]
    assert inner.records == []  # the wrapped controller never sees long steps
    source.run = 10  # the source has 10 tokens left
    assert _step(controller) == 10


def test_a_loss_sets_the_next_draft_to_the_run_that_ended():
    controller = LongDrafts(Recording(3), Source(1000), long_max=64)
    assert [_step(controller) for _ in range(3)] == [4, 8, 16]
    assert _step(controller, accepted=2) == 32  # the run ends: 4 + 8 + 16 + 2 kept
    assert _step(controller, accepted=0) == 30  # a run of 0 ends
    assert _step(controller, accepted=1) == LONG_START  # (the shortest long draft); a run of 1 ends
    assert [_step(controller) for _ in range(2)] == [LONG_START, 8]


def test_long_max_zero_never_drafts_past_the_wrapped_controller():
    controller = LongDrafts(Recording(3), Source(1000), long_max=2)
    assert [_step(controller) for _ in range(3)] == [2, 2, 2]
