"""Every registered drafter (``drafters/registry.py``) through the same checks, so that a new drafter is
tested by registering it, with no change here:

- greedy identity, batch invariance and rollback: under every cache setting, each request's greedy tokens
  with speculation are plain decoding's, served alone (``Engine``) and batched with others (``BatchEngine``,
  run twice so that slots and the prefix cache are reused);
- the distribution: sampled with speculation, many requests batched, the first three tokens follow the
  target's exact joint distribution (``distribution_check.py``), and drafts were verified on the way;
- the spec tells the truth: a drafter keeps a cache of its own exactly when its spec says so.

Head drafters read random head files written for the tiny target; the draft model is the target truncated
(greedy) or another small model (sampling), drafting over half the vocabulary; layerskip skips layer 1. A drafter
that uses a draft model when given one (``DrafterSpec.uses``: ``auto``) goes through every check without and with it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from batch_cases import CACHE_SETTINGS, requests
from distribution_check import (ALPHA, NEW_TOKENS, PROMPT, SAMPLES, SETTINGS, VOCAB, chi_square_p_value, exact_joint,
                                next_probs, small_vocab_model, small_vocab_target)
from specdecode.batch.executor import BatchEngine
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.drafters import DrafterInputs, Needs, registry
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.kv.cache import CacheConfig
from specdecode.models.transformer import Transformer
from tiny_models import varied_model, write_head_file

pytestmark = pytest.mark.usefixtures("one_thread")

DRAFTERS = list(registry.names())
# (drafter, given a draft model): each drafter as it runs by default, and those that use a draft model when given
# one once more with it.
CASES = [(name, bool(registry.spec(name).needs & Needs.DRAFT_MODEL)) for name in DRAFTERS] + \
    [(name, True) for name in registry.names_where(lambda spec: bool(spec.uses & Needs.DRAFT_MODEL))]
CASE_IDS = [name + ("+draft" if with_model and not registry.spec(name).needs & Needs.DRAFT_MODEL else "")
            for name, with_model in CASES]


def _inputs(name: str, target: Transformer, draft_model: Transformer | None, cache: CacheConfig, folder: Path,
            head_vocab: list[int] | None = None, tree_width: int = 2) -> DrafterInputs:
    """Everything any drafter may need; each reads what its spec names (``draft_model`` None: none given). A draft
    model drafts over the first half of the vocabulary and the last id (as the target's end-of-sequence id), as
    its default draft vocabulary does on a large vocabulary."""
    spec = registry.spec(name)
    head = None
    if spec.needs & Needs.HEAD:
        head = write_head_file(folder / f"{spec.head_kind}.safetensors", spec.head_kind, target, head_vocab, seed=3)
    vocab_size = target.config.vocab_size
    return DrafterInputs(target=target, draft_model=draft_model, skip_layers=(1,), draft_cache=cache, head=head,
                         draft_vocab=vocab_size // 2 if draft_model is not None else None,
                         eos_ids=(vocab_size - 1,), tree_width=tree_width)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return varied_model(0)


@pytest.fixture(scope="module")
def draft_model() -> Transformer:
    return varied_model(0, keep_layers=[0, 1])  # the target truncated: agrees often, not always


@pytest.fixture(scope="module")
def plain(target):
    """setting -> plain decoding's greedy tokens for each request under that cache setting."""
    done: dict[str, list[list[int]]] = {}

    def get(setting: str) -> list[list[int]]:
        if setting not in done:
            engine = Engine(target, cache=CACHE_SETTINGS[setting])
            done[setting] = [engine.generate(**r).token_ids for r in requests()]
        return done[setting]
    return get


def test_every_drafter_is_registered_once_with_a_summary_and_plain_decoding_is_none_of_them():
    assert registry.names()[0] == "ngram" and len(set(registry.names())) == len(registry.names())
    assert set(DRAFTERS) >= {"ngram", "ngram-tree", "draft", "draft-tree", "layerskip", "eagle", "eagle-tree", "medusa"}
    assert "none" not in registry.names()
    assert all(registry.spec(name).summary for name in registry.names())
    with pytest.raises(ValueError, match="unknown drafter 'warp'; expected one of ngram, ngram-tree"):
        registry.spec("warp")
    with pytest.raises(ValueError, match="unknown drafter 'none'"):
        registry.spec("none")


@pytest.mark.parametrize("setting", CACHE_SETTINGS)
@pytest.mark.parametrize("name,with_model", CASES, ids=CASE_IDS)
def test_greedy_tokens_are_plain_decodings_alone_and_batched(target, draft_model, plain, tmp_path, name, with_model,
                                                             setting):
    cache = CACHE_SETTINGS[setting]
    inputs = _inputs(name, target, draft_model if with_model else None, cache, tmp_path)
    want = plain(setting)
    solo = Engine(target, drafter=registry.build(name, inputs), spec=SpeculativeConfig(gamma=4), cache=cache)
    assert [solo.generate(**r).token_ids for r in requests()] == want, (name, setting, "alone")
    assert (solo.drafter.own_cache is not None) == (registry.spec(name).owns_cache or with_model)
    if registry.spec(name).needs & Needs.DRAFT_MODEL:
        ids = solo.drafter.vocab.ids.tolist()  # its draft vocabulary: the end id, then the first ids
        assert len(ids) == target.config.vocab_size // 2 and ids[-1] == target.config.vocab_size - 1
    engine = BatchEngine(target, new_drafter=lambda: registry.build(name, inputs), spec=SpeculativeConfig(gamma=4),
                         cache=cache, scheduler=SchedulerConfig(max_running=3), max_len=96)
    for _ in range(2):  # the second round reuses the slots (and the prefix cache)
        results = engine.run(requests())
        assert [r.token_ids for r in results] == want, (name, setting, "batched")
        assert all(r.finish_reason == "length" for r in results)
    assert sum(r.stats.drafted_tokens for r in results) > 0  # drafts were verified
    if not registry.spec(name).needs & Needs.HEAD:
        assert sum(r.stats.accepted_tokens for r in results) > 0  # and some kept (random heads may get none)
    assert engine.scheduler.slots.free == 3 and all(t.referenced == 0 for t in engine.memory.prefixes.values())


@pytest.mark.parametrize("name,with_model", CASES, ids=CASE_IDS)
def test_sampled_tokens_follow_the_targets_distribution(tmp_path, name, with_model):
    """SAMPLES requests with different seeds, served 8 at a time (so each step verifies several requests'
    drafts together, and each slot's drafter rolls back its own state)."""
    target = small_vocab_target()
    sampling = SETTINGS[0]  # T=1; test_distribution.py sweeps the other settings
    # A head drafts over the target's 4 least likely first tokens, so its mass sits where the target's is not.
    unlikely = next_probs(target, [PROMPT], sampling)[0].argsort()[:4].tolist()
    inputs = _inputs(name, target, small_vocab_model(11, layers=1) if with_model else None, CacheConfig(), tmp_path,
                     unlikely, tree_width=3)
    gamma = 6 if registry.spec(name).tree else 3
    engine = BatchEngine(target, new_drafter=lambda: registry.build(name, inputs), spec=SpeculativeConfig(gamma=gamma),
                         scheduler=SchedulerConfig(max_running=8, max_waiting=SAMPLES), max_len=64)
    results = engine.run([dict(prompt=PROMPT, sampling=replace(sampling, seed=seed), max_new_tokens=NEW_TOKENS,
                               eos_token_ids=()) for seed in range(SAMPLES)])
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    p_value = chi_square_p_value(counts, exact_joint(target, sampling))
    assert p_value > ALPHA, f"{name}: chi-square p = {p_value:.2e}"
    drafted, accepted = sum(r.stats.drafted_tokens for r in results), sum(r.stats.accepted_tokens for r in results)
    assert drafted >= SAMPLES and 0 < accepted < drafted, (name, drafted, accepted)
