"""Drafting with a separate model: vocabulary check and cache rollback."""

from __future__ import annotations

import pytest
import torch

from specdecode.drafters import DrafterInputs, registry
from specdecode.drafters import draft_model as draft_model_module
from specdecode.drafters.draft_model import (FULL_VOCAB_SHARE, DraftModelDrafter, VocabularyMismatchError,
                                             check_same_vocabulary, covers, draft_vocabulary)
from specdecode.heads.vocab import VocabHead
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import from_hf_tensors
from specdecode.models.rows import LogitRows
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams, probs_from_logits
from tiny_models import random_hf_tensors, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.9, top_k=40)


def _model(seed: int, layers: int) -> Transformer:
    # Weights at scale 0.2 give varied (non-repeating) greedy continuations.
    config = tiny_config("llama", num_layers=layers)
    return from_hf_tensors(config, random_hf_tensors(config, seed, scale=0.2))


@pytest.fixture(scope="module")
def draft_model() -> Transformer:
    return _model(1, layers=2)


def _drafter(model: Transformer, max_len: int = 64) -> DraftModelDrafter:
    drafter = DraftModelDrafter(model)
    drafter.reset(KVCacheStub(max_len))
    return drafter


class KVCacheStub:
    """What reset() reads of the target's cache."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len


# --------------------------------------------------------------------------- vocabulary check


def test_same_vocabulary_passes():
    check_same_vocabulary(["a", "b", "c"], ["a", "b", "c"], 3, 3)


def test_vocabulary_mismatch_names_first_differing_id():
    with pytest.raises(VocabularyMismatchError, match=r"target has 4 tokens, draft 4; first difference at id 2"):
        check_same_vocabulary(["a", "b", "c", "d"], ["a", "b", "x", "y"], 4, 4)


def test_vocabulary_of_different_length_names_end_of_common_prefix():
    with pytest.raises(VocabularyMismatchError, match=r"target has 3 tokens, draft 5; first difference at id 3"):
        check_same_vocabulary(["a", "b", "c"], ["a", "b", "c", "d", "e"], 5, 5)


def test_head_size_mismatch():
    with pytest.raises(VocabularyMismatchError, match=r"draft output head has 64 rows but the target's has 65"):
        check_same_vocabulary(["a", "b"], ["a", "b"], 65, 64)
    assert issubclass(VocabularyMismatchError, ValueError)


def test_the_registry_builds_draft_with_a_draft_model_only(draft_model):
    with pytest.raises(ValueError, match="needs a draft model"):
        registry.build("draft", DrafterInputs(target=draft_model))
    d = registry.build("draft", DrafterInputs(target=draft_model, draft_model=draft_model))
    assert isinstance(d, DraftModelDrafter) and d.model is draft_model


# --------------------------------------------------------------------------- cache consistency


def _reference_next_logits(model: Transformer, seq: list[int]) -> torch.Tensor:
    cache = model.new_cache(CacheConfig(max_len=len(seq)))
    return model(torch.tensor([seq]), cache, logits=LogitRows.LAST).logits[0, -1]


def test_reset_sizes_cache_like_the_target(draft_model):
    drafter = DraftModelDrafter(draft_model)
    drafter.reset(KVCacheStub(40))
    assert drafter.cache.max_len == 40 and drafter.cache.lengths == [0]
    first = drafter.cache
    drafter.cache.advance([0], 5)
    drafter.reset(KVCacheStub(20))  # smaller: reused, emptied
    assert drafter.cache is first and drafter.cache.lengths == [0]
    drafter.reset(KVCacheStub(80))  # larger: regrown
    assert drafter.cache.max_len == 80


def test_greedy_draft_is_the_draft_models_own_greedy_continuation(draft_model):
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    drafter = _drafter(draft_model)
    draft = drafter.propose(seq, 5, GREEDY, torch.Generator())
    assert draft.q is None and len(draft.tokens) == 5
    want, s = [], list(seq)
    for _ in range(5):
        want.append(int(_reference_next_logits(draft_model, s).argmax()))
        s.append(want[-1])
    assert draft.tokens == want
    assert drafter.cache.lengths[0] == len(seq) + 5 - 1  # the last drafted token is never fed


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_commit_rolls_back_and_later_drafts_match_a_fresh_drafter(draft_model, sampling):
    """Simulates engine steps with various acceptance counts; after each commit the cache holds
    min(previous, len(seq) - 1) tokens, and the next draft equals that of a fresh drafter (same tokens,
    same q) fed the same sequence."""
    drafter = _drafter(draft_model)
    seq = [10, 20, 30, 40, 50]
    g = torch.Generator().manual_seed(0)
    k = 4
    # (accepted draft tokens, correction/bonus token) per step: reject all, partial, accept all, ...
    plan = [(0, 90), (2, 91), (4, 92), (1, 93), (3, 94), (0, 95)]
    for step, (accepted, extra) in enumerate(plan):
        draft = drafter.propose(seq, k, sampling, g)
        before = drafter.cache.lengths[0]
        assert before == len(seq) + k - 1
        seq = seq + draft.tokens[:accepted] + [extra]
        drafter.commit(seq)
        assert drafter.cache.lengths[0] == min(before, len(seq) - 1)

        fresh = _drafter(draft_model)
        seed = 100 + step
        mine = drafter.propose(seq, k, sampling, torch.Generator().manual_seed(seed))
        ref = fresh.propose(seq, k, sampling, torch.Generator().manual_seed(seed))
        assert mine.tokens == ref.tokens
        if sampling.greedy:
            assert mine.q is None and ref.q is None
        else:
            assert mine.q.shape == (k, draft_model.config.vocab_size)
            torch.testing.assert_close(mine.q, ref.q, atol=1e-4, rtol=0)
        # Undo the probe's draft so the next planned step drafts from a committed state again.
        drafter.commit(seq)
        assert drafter.cache.lengths[0] == len(seq) - 1


def test_commit_after_a_step_without_drafting_keeps_the_cache(draft_model):
    """When the engine drafts nothing (k = 0) the drafter's cache is short; commit must not grow or break it."""
    drafter = _drafter(draft_model)
    seq = [7, 8, 9]
    drafter.propose(seq, 2, GREEDY, torch.Generator())
    drafter.commit(seq + [1])  # accepted 0, correction 1: cache back to 3
    assert drafter.cache.lengths[0] == 3
    seq = seq + [1, 2, 3]  # two more engine steps with no draft
    drafter.commit(seq)
    assert drafter.cache.lengths[0] == 3
    ref = _drafter(draft_model).propose(seq, 3, GREEDY, torch.Generator())
    assert drafter.propose(seq, 3, GREEDY, torch.Generator()).tokens == ref.tokens


def test_sampled_q_is_the_processed_draft_distribution(draft_model):
    seq = [11, 12, 13]
    drafter = _drafter(draft_model)
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    draft = drafter.propose(seq, 1, params, torch.Generator().manual_seed(3))
    logits = _reference_next_logits(draft_model, seq)
    torch.testing.assert_close(draft.q[0], probs_from_logits(logits, params), atol=1e-4, rtol=0)
    assert draft.q[0, draft.tokens[0]] > 0
    assert (draft.q[0] > 0).sum() <= 5


def test_a_draft_with_another_head_size_is_refused_at_construction():
    target = tiny_model("llama", seed=0)
    other = tiny_model("llama", seed=1, vocab_size=target.config.vocab_size + 3)
    with pytest.raises(VocabularyMismatchError, match="rows"):
        DraftModelDrafter(other, target)


def test_reset_prefills_the_prompt_so_drafting_feeds_only_the_last_token():
    model = tiny_model("llama", seed=0)
    drafter = DraftModelDrafter(model)
    drafter.reset(model.new_cache(CacheConfig(max_len=32)), [1, 2, 3, 4, 5])
    assert drafter.cache.lengths[0] == 4
    fresh = DraftModelDrafter(model)
    fresh.reset(model.new_cache(CacheConfig(max_len=32)))
    draw = lambda d: d.propose([1, 2, 3, 4, 5], 3, SamplingParams(), torch.Generator()).tokens  # noqa: E731
    assert draw(drafter) == draw(fresh)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_signals_are_the_drafts_top1_and_entropy_and_a_stop_ends_the_draft(draft_model, sampling):
    seq = [3, 9, 27, 81, 4]
    full = _drafter(draft_model).propose(seq, 5, sampling, torch.Generator().manual_seed(0))
    assert full.signals == []  # computed only when asked for (with a stop rule)
    seen = []

    def stop(position, signal):
        seen.append((position, signal))
        return position == 2

    drafter = _drafter(draft_model)
    draft = drafter.propose(seq, 5, sampling, torch.Generator().manual_seed(0), stop=stop)
    assert draft.tokens == full.tokens[:3] and [p for p, _ in seen] == [0, 1, 2]
    assert draft.signals == [s for _, s in seen]
    if sampling is SAMPLED:
        assert draft.q.shape[0] == 3
    # The draft's own next-token distributions (temperature 1), one forward per kept token and no more.
    assert drafter.cache.lengths[0] == len(seq) + 2
    cache = draft_model.new_cache(CacheConfig(max_len=16))
    logits = draft_model(torch.tensor([seq + draft.tokens[:2]]), cache).logits[0, len(seq) - 1:]
    for (top1, entropy), row in zip(draft.signals, logits):
        p = torch.softmax(row.float(), -1)
        assert top1 == pytest.approx(float(p.max()), abs=1e-4)
        assert entropy == pytest.approx(float(-(p * p.log()).sum()), abs=1e-3)


def test_draft_cache_follows_its_own_settings_and_commits_what_the_target_verified(draft_model):
    from specdecode.kv.compressed import CompressedCache
    from specdecode.kv.memory import KVMemory

    config = CacheConfig(kv_dtype="int8", group_size=4, residual=4, prefill_chunk=8)
    drafter = registry.build("draft", DrafterInputs(target=draft_model, draft_model=draft_model, draft_cache=config))
    memory = KVMemory()
    drafter.reset(KVCacheStub(64), list(range(1, 30)), memory)
    assert isinstance(drafter.cache, CompressedCache) and drafter.cache.max_len == 64
    assert memory.caches["draft"] is drafter.cache  # allocated under the engine's memory
    assert drafter.cache.committed[0] == 28 and drafter.cache.flushed[0][0] > 0  # the prompt is verified
    seq = list(range(1, 30))
    draft = drafter.propose(seq, 4, GREEDY, torch.Generator())
    assert drafter.cache.committed[0] == 28  # drafts are not
    drafter.commit(seq + draft.tokens[:2] + [5])
    assert drafter.cache.committed[0] == drafter.cache.lengths[0] == 31
    drafter.reset(KVCacheStub(64), [1, 2], KVMemory())  # another engine's memory: a cache of its own there
    assert drafter.cache.lengths == [1]


# --------------------------------------------------------------------------- draft vocabulary


def test_draft_vocabulary_is_the_end_ids_and_the_first_ids_or_none_for_all(draft_model):
    v = draft_model.config.vocab_size
    vocab = draft_vocabulary(draft_model, 10, always=[v - 1])
    assert vocab.ids.tolist() == [*range(9), v - 1]
    assert draft_vocabulary(draft_model, 0) is None and draft_vocabulary(draft_model, v) is None
    with pytest.raises(ValueError, match="--draft-vocab must be >= 0"):
        draft_vocabulary(draft_model, -1)
    for wrong in (v, -1):
        with pytest.raises(ValueError, match=rf"must lie in 0..{v - 1}, got \[{wrong}\]"):
            draft_vocabulary(draft_model, 10, always=[wrong])


def _restricted(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    out = torch.full_like(logits, float("-inf"))
    out[ids] = logits[ids]
    return out


@pytest.mark.parametrize("tree_width", [0, 2], ids=["chain", "tree"])
def test_a_draft_vocabulary_drafts_the_models_greedy_pick_among_its_ids_and_the_requests(draft_model, tree_width):
    ids = [*range(0, 97, 3), 50]  # every third id and one more: picks outside are likely without the cut
    drafter = DraftModelDrafter(draft_model, tree_width=tree_width, vocab=VocabHead(draft_model, torch.tensor(ids)))
    drafter.reset(KVCacheStub(64))
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    allowed = sorted({*ids, *seq})  # the request's own tokens are draftable too
    draft = drafter.propose(seq, 4, GREEDY, torch.Generator())
    want, s = [], list(seq)
    for _ in range(4 if not tree_width else 1):  # a tree's first node is the first pick
        want.append(int(_restricted(_reference_next_logits(draft_model, s), allowed).argmax()))
        s.append(want[-1])
    assert draft.tokens[:len(want)] == want and set(draft.tokens) <= set(allowed)
    unrestricted = DraftModelDrafter(draft_model, tree_width=tree_width)
    unrestricted.reset(KVCacheStub(64))
    assert unrestricted.propose(seq, 4, GREEDY, torch.Generator()).tokens != draft.tokens  # the cut changed a pick


def test_a_token_of_the_request_outside_the_draft_vocabulary_can_be_drafted(draft_model):
    seq = [7, 8, 9, 10, 11]
    while (best := int(_reference_next_logits(draft_model, seq).argmax())) not in seq:  # greedy until a repeat
        seq.append(best)
    base = VocabHead(draft_model, torch.tensor([i for i in range(97) if i != best]))  # all but the pick
    assert seq.count(best) / len(seq) <= FULL_VOCAB_SHARE  # the prompt is the base's: drafts use it
    drafter = DraftModelDrafter(draft_model, vocab=base)
    drafter.reset(KVCacheStub(64), seq)
    assert drafter.propose(seq, 1, GREEDY, torch.Generator()).tokens == [best]  # drafted as the request's own


def test_a_prompt_mostly_outside_the_draft_vocabulary_drafts_over_every_id(draft_model):
    seq = [60, 61, 62, 63, 64, 5]  # a sixth inside the base
    base = VocabHead(draft_model, torch.tensor(range(10)))
    assert not covers(base, seq) and covers(base, [60, 1, 2, 3]) and covers(base, [])
    params = SamplingParams(temperature=0.9)
    outside = DraftModelDrafter(draft_model, vocab=base)
    outside.reset(KVCacheStub(64), seq)
    whole = DraftModelDrafter(draft_model)
    whole.reset(KVCacheStub(64), seq)
    got = outside.propose(seq, 2, params, torch.Generator().manual_seed(5))
    want = whole.propose(seq, 2, params, torch.Generator().manual_seed(5))
    assert got.tokens == want.tokens and torch.equal(got.q, want.q) and (got.q[0, 10:] > 0).any()


def test_a_draft_models_default_vocabulary_is_draft_vocab_ids(draft_model, monkeypatch):
    monkeypatch.setattr(draft_model_module, "DRAFT_VOCAB", 12)
    assert draft_vocabulary(draft_model, None, always=[96]).ids.tolist() == [*range(11), 96]
    monkeypatch.setattr(draft_model_module, "DRAFT_VOCAB", 97)
    assert draft_vocabulary(draft_model, None) is None  # as large as the vocabulary: the whole head


def test_a_draft_vocabularys_q_is_the_processed_distribution_over_its_ids_and_the_requests(draft_model):
    ids = list(range(0, 97, 2))
    drafter = DraftModelDrafter(draft_model, vocab=VocabHead(draft_model, torch.tensor(ids)))
    seq = [11, 12, 13, 14, 16, 18, 20, 22]  # a quarter outside the base: the request's own join it
    drafter.reset(KVCacheStub(64), seq)
    params = SamplingParams(temperature=0.9)
    draft = drafter.propose(seq, 1, params, torch.Generator().manual_seed(3))
    allowed = sorted({*ids, *seq})
    want = probs_from_logits(_restricted(_reference_next_logits(draft_model, seq), allowed), params)
    torch.testing.assert_close(draft.q[0], want, atol=1e-4, rtol=0)
    outside = [i for i in range(97) if i not in allowed]
    assert draft.q[0, outside].sum() == 0 and draft.q[0, [11, 13]].sum() > 0 and draft.tokens[0] in allowed
