"""auto: each step the free source whose proposal expects the most accepted tokens, calibrated by what each source's
drafts got accepted; every source alone keeps greedy decoding exact."""

from __future__ import annotations

import pytest
import torch

from batch_cases import requests
from specdecode.batch.executor import BatchEngine
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.drafters import DrafterInputs, registry
from specdecode.drafters.auto import SOURCES, AutoDrafter, Calibration
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


def test_calibration_counts_the_accepted_prefix():
    prompt = [1, 2, 3, 4, 5, 6, 7, 9, 3]
    calibration = Calibration(prior=1.0, decay=1.0)
    drafter = _started(prompt, calibration=calibration, sources=("ngram",))
    _propose(drafter, prompt, 5)
    drafter.commit(prompt + [4, 5, 0])  # two of five kept, then the target's own token
    assert calibration.sums["ngram"] == [1.0 + 5.0, 1.0 + 2.0]


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
