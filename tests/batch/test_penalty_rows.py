"""Penalties (presence, frequency, repetition, ``logit_bias``) and min-p stay exact under speculation: each verified
row is penalized by the tokens before it, drafted ones included. Greedy speculation with drafters that propose
penalized tokens (n-gram lookup on a repetitive prompt proposes repeats) gives plain penalized greedy decoding's
tokens, alone, batched and under every cache setting; sampled, the first three tokens follow the exact joint of
plain penalized decoding (``distribution_check.py``'s chi-square test), with a negative control that penalizes
every row by the request's tokens only (not its path) and is caught."""

from __future__ import annotations


import pytest
import torch

from batch_cases import CACHE_SETTINGS, requests
from distribution_check import (ALPHA, PROMPT, SAMPLES, VOCAB, chi_square_p_value, sample_counts, small_vocab_model,
                                small_vocab_target)
from specdecode.batch import penalty_rows
from specdecode.batch.executor import BatchEngine
from specdecode.batch.penalty_rows import row_paths
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.drafters import DraftModelDrafter, NgramDrafter, NgramTreeDrafter
from specdecode.drafters.base import Draft
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.kv.cache import CacheConfig
from specdecode.models.rows import LogitRows
from specdecode.sampling import Penalties, SamplingParams, penalize, probs_from_logits
from tiny_models import varied_model

pytestmark = pytest.mark.usefixtures("one_thread")

PENALTIES = {
    "presence": Penalties(presence=1.5),
    "frequency": Penalties(frequency=0.8),
    "repetition": Penalties(repetition=1.8),
    "bias": Penalties(bias=((7, -4.0), (8, 3.0))),
    "all": Penalties(presence=0.5, frequency=0.5, repetition=1.3, bias=((9, -2.0),)),
}
DRAFTERS = {"ngram": lambda: NgramDrafter(min_ngram=1, max_ngram=3), "ngram-tree": NgramTreeDrafter}


def test_row_paths_follow_chains_and_trees():
    assert row_paths(Draft([5, 6, 7])) == [[], [5], [5, 6], [5, 6, 7]]
    assert row_paths(Draft([5, 6, 7, 8], parents=[-1, 0, -1, 2])) == [[], [5], [5, 6], [7], [7, 8]]


@pytest.fixture(scope="module")
def target():
    return varied_model(0)


# Every penalty with n-gram lookup; trees (ngram-tree) with all of them at once, the rest with `-m slow`.
@pytest.mark.parametrize("name, kind", [(name, "ngram") for name in PENALTIES] + [
    pytest.param(name, "ngram-tree", marks=[] if name == "all" else pytest.mark.slow) for name in PENALTIES])
def test_penalized_greedy_speculation_is_plain_penalized_greedy_alone_and_batched(target, name, kind):
    sampling = SamplingParams(penalties=PENALTIES[name])
    asked = [dict(r, sampling=sampling) for r in requests()]
    plain = [Engine(target).generate(**r).token_ids for r in asked]
    assert plain != [Engine(target).generate(**r).token_ids for r in requests()]  # the penalties changed the output
    alone = Engine(target, drafter=DRAFTERS[kind](), spec=SpeculativeConfig(gamma=4))
    results = [alone.generate(**r) for r in asked]
    assert [r.token_ids for r in results] == plain, (name, kind)
    assert sum(r.stats.drafted_tokens for r in results) > 0
    batched = BatchEngine(target, new_drafter=DRAFTERS[kind], spec=SpeculativeConfig(gamma=4),
                          scheduler=SchedulerConfig(max_running=3), max_len=96).run(asked)
    assert [r.token_ids for r in batched] == plain, (name, kind)


@pytest.mark.parametrize("setting", CACHE_SETTINGS)
def test_penalized_greedy_speculation_holds_under_every_cache_setting(target, setting):
    cache: CacheConfig = CACHE_SETTINGS[setting]
    asked = [dict(r, sampling=SamplingParams(penalties=PENALTIES["all"])) for r in requests()]
    plain = [Engine(target, cache=cache).generate(**r).token_ids for r in asked]
    engine = BatchEngine(target, new_drafter=DRAFTERS["ngram"], spec=SpeculativeConfig(gamma=4), cache=cache,
                         scheduler=SchedulerConfig(max_running=3), max_len=96)
    assert [r.token_ids for r in engine.run(asked)] == plain, setting


# ------------------------------------------------------------------ the distribution, sampled


@pytest.fixture(scope="module")
def small():
    return small_vocab_target()


def _penalized_joint(model, sampling: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) of plain decoding with ``sampling``'s penalties: each position's logits penalized by
    the tokens generated before it, [V, V, V]."""
    def probs(generated: list[int]) -> torch.Tensor:
        seq = PROMPT + generated
        logits = model(torch.tensor([seq]), model.new_cache(CacheConfig(max_len=len(seq))),
                       logits=LogitRows.LAST).logits[0, -1:].float()
        penalize(logits, sampling.penalties, PROMPT, generated, [[]])
        return probs_from_logits(logits[0], sampling)
    p1 = probs([])
    p2 = torch.stack([probs([a]) for a in range(VOCAB)])
    p3 = torch.stack([probs([a, b]) for a in range(VOCAB) for b in range(VOCAB)])
    return p1[:, None, None] * p2[:, :, None] * p3.view(VOCAB, VOCAB, VOCAB)


# One sampled case in the default suite (with the negative control); the others with `-m slow`.
SAMPLED = [
    pytest.param("ngram", SamplingParams(temperature=1.0, penalties=Penalties(presence=1.0, frequency=0.7)),
                 id="ngram-presence-frequency"),
    pytest.param("draft", SamplingParams(temperature=1.0, penalties=Penalties(repetition=1.6, bias=((2, 1.5),))),
                 id="draft-repetition-bias", marks=pytest.mark.slow),
    pytest.param("draft", SamplingParams(temperature=0.8, min_p=0.1, penalties=Penalties(frequency=1.0)),
                 id="draft-min_p-frequency", marks=pytest.mark.slow),
]


def _small_drafter(kind: str):
    return NgramDrafter(min_ngram=1, max_ngram=2) if kind == "ngram" else DraftModelDrafter(small_vocab_model(11, 1))


@pytest.mark.parametrize("kind, sampling", SAMPLED)
def test_penalized_sampling_follows_plain_penalized_decoding(small, kind, sampling):
    engine = Engine(small, drafter=_small_drafter(kind), spec=SpeculativeConfig(gamma=3))
    drafted = []
    counts = sample_counts(engine, sampling, on_result=lambda r: drafted.append(r.stats.drafted_tokens))
    p_value = chi_square_p_value(counts, _penalized_joint(small, sampling))
    assert p_value > ALPHA, f"{kind} at {sampling}: chi-square p = {p_value:.2e}"
    assert sum(drafted) > SAMPLES  # drafts were verified, several per request


def test_negative_control_penalizing_rows_without_their_drafted_path_is_detected(small, monkeypatch):
    """Why each row's path counts: penalized by the request's tokens alone, a row after a drafted token scores that
    token as if it had not been written, and the sampled distribution drifts from plain decoding's."""
    monkeypatch.setattr(penalty_rows, "row_paths", lambda draft: [[] for _ in range(1 + len(draft.tokens))])
    sampling = SamplingParams(temperature=1.0, penalties=Penalties(presence=2.0, frequency=2.0))
    engine = Engine(small, drafter=_small_drafter("draft"), spec=SpeculativeConfig(gamma=3))
    counts = sample_counts(engine, sampling)
    p_value = chi_square_p_value(counts, _penalized_joint(small, sampling))
    assert p_value < ALPHA, f"the wrong rows passed: p = {p_value:.2e}"
