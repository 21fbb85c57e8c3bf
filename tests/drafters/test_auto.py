"""auto: each step the source whose proposal expects the most accepted tokens, calibrated by what each source's
drafts got accepted; every source alone keeps greedy decoding exact; with a draft model, the model drafts where the
free sources expect less than its drafts get accepted, and catches up on what it did not draft."""

from __future__ import annotations

import pytest
import torch

from batch_cases import requests
from specdecode.batch.executor import BatchEngine
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.drafters import DrafterInputs, registry
from specdecode.drafters.auto import AUTO_DRAFT, MODEL, SOURCES, AutoDrafter, Calibration
from specdecode.drafters.base import MODEL_SIGNALS
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.sampling import SamplingParams
from tiny_models import varied_model

GREEDY = SamplingParams()


def _started(prompt: list[int], **kwargs) -> AutoDrafter:
    drafter = AutoDrafter(**kwargs)
    drafter.reset(None, prompt)
    return drafter


def _propose(drafter: AutoDrafter, seq: list[int], k: int):
    return drafter.propose(seq, k, GREEDY, torch.Generator(), lambda position, signal: False)


def test_prompt_lookup_drafts_where_the_suffix_source_has_too_short_a_match():
    prompt = [1, 2, 3, 4, 5, 6, 7, 9, 3]
    # suffix: the tail "3" drafts ceil(1 x 1) = 1 token; prompt lookup the 5 that followed "3", which expect more
    assert _propose(_started(prompt), prompt, 5).tokens == [4, 5, 6, 7, 9]
    assert _propose(_started(prompt, sources=("suffix",)), prompt, 5).tokens == [4]
    assert _propose(_started(prompt, sources=("ngram",)), prompt, 5).tokens == [4, 5, 6, 7, 9]


def test_a_source_whose_drafts_are_rejected_loses_its_turn():
    prompt = [1, 2, 3, 4, 5, 6, 7, 9, 3]
    calibration = Calibration()
    drafter = _started(prompt, calibration=calibration)
    drafts = []
    for _ in range(3):  # each draft rejected at its first token
        drafts.append(_propose(drafter, prompt, 5).tokens)
        drafter.commit(prompt + [8])
        drafter.reset(None, prompt)
    assert drafts == [[4, 5, 6, 7, 9]] * 2 + [[4]]  # suffix's one token then expects more
    assert calibration.factor("ngram") < 0.2 < calibration.factor("suffix") < 1.0


def test_past_unverified_tokens_prompt_lookup_drafts_and_the_suffix_tries_wait_for_verification():
    # A grammar's forced tokens are drafted ahead of it (forced.py): the draft after them may not take them into the
    # tries before the target has kept them.
    prompt = [1, 2, 3, 4, 5, 6, 7, 9, 3]
    drafter = _started(prompt)
    assert drafter.drafts_past_unverified
    seen = drafter.suffix._seen
    assert _propose(drafter, prompt + [4], 3).tokens == [5, 6, 7]  # "3 4" seen before: prompt lookup goes on
    assert drafter.suffix._seen == seen
    suffix_only = _started(prompt, sources=("suffix",))
    assert _propose(suffix_only, prompt + [4], 3).tokens == []  # nothing else may draft there
    drafter.commit(prompt + [4, 5, 6])
    assert _propose(drafter, prompt + [4, 5, 6], 2).tokens == [7, 9] and drafter.suffix._seen == len(prompt) + 3


def test_calibration_counts_the_accepted_prefix():
    prompt = [1, 2, 3, 4, 5, 6, 7, 9, 3]
    calibration = Calibration(prior=1.0, decay=1.0)
    drafter = _started(prompt, calibration=calibration, sources=("ngram",))
    _propose(drafter, prompt, 5)
    drafter.commit(prompt + [4, 5, 0])  # two of five kept, then the target's own token
    assert calibration.sums["ngram"] == [1.0 + 5.0, 1.0 + 2.0]


def test_forgetting_drops_the_calibration_and_the_cache_of_earlier_outputs():
    prompt = [1, 2, 3, 4, 5, 6, 7, 9, 3]
    drafter = _started(prompt)
    _propose(drafter, prompt, 5)
    drafter.commit(prompt + [8])
    drafter.finish(prompt + [8])
    assert drafter.calibration.factor("ngram") < 1.0 and drafter.learned()[0] == 1
    drafter.forget()
    assert drafter.calibration.factor("ngram") == 1.0 and drafter.learned()[0] == 0


def test_unknown_sources_are_refused():
    with pytest.raises(ValueError, match="auto's sources"):
        AutoDrafter(sources=("ngram", "draft"))
    with pytest.raises(ValueError, match="auto's sources"):
        AutoDrafter(sources=())


@pytest.mark.parametrize("sources", [(s,) for s in SOURCES] + [SOURCES])
def test_each_source_forced_on_keeps_greedy_decoding_exact_alone_and_batched(sources):
    target = varied_model(0)
    plain = Engine(target)
    want = [plain.generate(**r).token_ids for r in requests()]
    solo = Engine(target, drafter=AutoDrafter(sources=sources), spec=SpeculativeConfig(gamma=4))
    got = [solo.generate(**r) for r in requests()]
    assert [r.token_ids for r in got] == want
    assert sum(r.stats.drafted_tokens for r in got) > 0, sources
    engine = BatchEngine(target, new_drafter=lambda: AutoDrafter(sources=sources), spec=SpeculativeConfig(gamma=4),
                         scheduler=SchedulerConfig(max_running=3), max_len=96)
    assert [r.token_ids for r in engine.run(requests())] == want


def test_the_slots_share_one_suffix_cache_and_one_calibration():
    inputs = DrafterInputs(target=varied_model(0))
    first, second = registry.build("auto", inputs), registry.build("auto", inputs)
    assert first.cache is second.cache and first.calibration is second.calibration


def _with_model(prompt: list[int], calibration: Calibration | None = None) -> tuple[AutoDrafter, DraftModelDrafter]:
    """auto over a draft model (the tiny target truncated), started on ``prompt``; and that model's drafter alone,
    started alike, to compare with."""
    target, small = varied_model(0), varied_model(0, keep_layers=[0, 1])
    engine = Engine(target)  # (a target cache for the drafters' own caches to follow)
    drafter = AutoDrafter(calibration=calibration or Calibration(), model=DraftModelDrafter(small, target))
    alone = DraftModelDrafter(small, target)
    for d in (drafter, alone):
        d.reset(engine.cache, prompt)
    return drafter, alone


def test_with_a_draft_model_it_is_named_for_it_and_gives_the_models_signals():
    drafter, _ = _with_model([5, 6, 7])
    assert drafter.name == AUTO_DRAFT and drafter.signal_names == MODEL_SIGNALS
    assert drafter.own_cache is drafter.model.own_cache and drafter.weight_nbytes == drafter.model.weight_nbytes > 0
    assert AutoDrafter().own_cache is None and AutoDrafter().name == "auto"


def test_the_model_drafts_where_the_free_sources_have_nothing_and_they_draft_where_they_expect_more():
    fresh = [11, 23, 5, 40, 17]  # no token repeats: no free proposal
    drafter, alone = _with_model(fresh)
    assert _propose(drafter, fresh, 3).tokens == _propose(alone, fresh, 3).tokens
    repeated = [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3]  # prompt lookup: 4 5 6 7 9, expecting more than the model's prior
    drafter, _ = _with_model(repeated)
    draft = _propose(drafter, repeated, 5)
    assert draft.tokens == [4, 5, 6, 7, 9]
    assert all(0.0 < top1 < 1.0 and entropy > 0.0 for top1, entropy in draft.signals)  # a free token's, as a model's


def test_a_model_whose_drafts_get_more_accepted_wins_over_a_weak_free_proposal():
    repeated = [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3]
    calibration = Calibration()
    calibration.sums[MODEL] = [1.0, 6.0]  # six tokens accepted per model draft
    drafter, alone = _with_model(repeated, calibration)
    assert _propose(drafter, repeated, 5).tokens == _propose(alone, repeated, 5).tokens


def test_the_model_catches_up_on_free_drafts_and_learns_its_tokens_per_draft():
    repeated = [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3]
    calibration = Calibration(prior=1.0, decay=1.0)
    drafter, _ = _with_model(repeated, calibration)
    assert _propose(drafter, repeated, 5).tokens == [4, 5, 6, 7, 9]  # free
    seq = repeated + [4, 5, 6, 30]  # three kept, then the target's own token
    drafter.commit(seq)
    calibration.sums[MODEL] = [1.0, 9.0]  # the model now expected to beat any free proposal
    _, alone = _with_model(seq)  # a model drafter started on the whole sequence
    model_draft = _propose(drafter, seq, 4).tokens
    assert model_draft == _propose(alone, seq, 4).tokens  # its cache caught up with the tokens it did not draft
    drafter.commit(seq + model_draft[:1] + [0])  # one of its tokens kept
    assert calibration.sums[MODEL] == [2.0, 10.0]


def test_a_batch_gives_each_slots_draft_model_a_cache_of_its_own():
    target, small = varied_model(0), varied_model(0, keep_layers=[0, 1])
    inputs = DrafterInputs(target=target, draft_model=small)
    engine = BatchEngine(target, new_drafter=lambda: registry.build("auto", inputs), spec=SpeculativeConfig(gamma=4),
                         scheduler=SchedulerConfig(max_running=3), max_len=96)
    engine.run(requests())
    names = {f"draft-{slot}" for slot in range(3)}
    assert names <= set(engine.memory.caches)  # counted in the KV budget, one per slot
    assert len({id(engine.memory.caches[name]) for name in names}) == 3
