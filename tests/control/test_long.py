"""LongDrafts (control/long.py): long draft sources run past the wrapped controller's bound, doubling while
every drafted token is kept, and a loss sets the next draft to the run that ended; without a long run the
wrapped controller decides and learns alone."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.control.base import FixedGamma, StepContext, StepRecord
from specdecode.control.estimates import StepCosts
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


def _costs(rows_cost: float) -> StepCosts:
    """Step costs of a plain step of 1 s whose every further row costs ``rows_cost`` s; drafting free."""
    costs = StepCosts(gamma_max=8, max_rows=64)
    costs.seed([1.0 + rows_cost * k for k in range(64)])
    costs.draft_per_token = 0.0
    return costs


BATCH = StepContext(remaining=500, context_len=100, max_context=4096, others_rows=7, others_tokens=7.0)


def test_in_a_batch_a_long_draft_runs_only_as_far_as_it_pays_at_the_whole_step():
    inner = Recording(0)
    cheap = LongDrafts(inner, Source(1000), long_max=64, costs=_costs(0.01))
    assert cheap.next_gamma(BATCH) == LONG_START  # rows nearly free: the whole long draft
    dear = LongDrafts(inner, Source(1000), long_max=64, costs=_costs(0.5))
    assert dear.next_gamma(BATCH) == 0  # each row half a step, for 8 sequences' step: the wrapped one decides
    dear.update(StepRecord(ctx=BATCH, requested=0, drafted=0, accepted=0, draft_s=0.0, verify_s=0.0))
    assert len(inner.records) == 1
    alone = LongDrafts(inner, Source(1000), long_max=64, costs=_costs(0.5))
    assert alone.next_gamma(CTX) == LONG_START  # a sequence alone: as before, unpriced


def test_a_long_drafts_price_follows_how_its_tokens_fared():
    controller = LongDrafts(Recording(0), Source(1000), long_max=64, costs=_costs(0.03))
    before = controller.acceptance
    assert controller.next_gamma(BATCH) == LONG_START
    for _ in range(6):  # every long draft loses its first token
        controller.update(StepRecord(ctx=BATCH, requested=4, drafted=4, accepted=0, draft_s=0.0, verify_s=0.0))
    assert controller.acceptance < before / 2
    assert controller.next_gamma(BATCH) < LONG_START  # cut to what pays at that acceptance, or none
