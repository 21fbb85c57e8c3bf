"""SuffixDecoding: drafting from the request's own trie and from the engine's cache of finished outputs."""

from __future__ import annotations

import pytest
import torch

from batch_cases import requests
from specdecode.batch.executor import BatchEngine
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.drafters import DrafterInputs, registry
from specdecode.drafters.suffix import LONG_MATCH, LONG_PROB, SUFFIX_SIGNALS, SuffixCache, SuffixDrafter
from specdecode.engine import SpeculativeConfig
from specdecode.sampling import SamplingParams
from specdecode.tree import check_tree
from tiny_models import varied_model

GREEDY = SamplingParams()


def _propose(drafter, seq: list[int], k: int, stop=None):
    return drafter.propose(seq, k, GREEDY, torch.Generator(), stop)


def _started(prompt: list[int], **kwargs) -> SuffixDrafter:
    drafter = SuffixDrafter(**kwargs)
    drafter.reset(None, prompt)
    return drafter


def test_drafts_what_followed_the_tail_in_the_prompt_one_hot():
    prompt = [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3]
    drafter = _started(prompt)
    draft = _propose(drafter, prompt, 8)
    assert draft.tokens == [4, 5, 6] and draft.q is None and draft.parents is None  # ceil(1.0 * 3) tokens
    assert _propose(_started(prompt, alpha=2.0), prompt, 8).tokens == [4, 5, 6, 7, 9, 1]
    assert _propose(drafter, prompt, 2).tokens == [4, 5]
    assert _propose(drafter, prompt, 0).tokens == []
    assert _propose(_started([1, 2, 3]), [1, 2, 3], 4).tokens == []  # its only occurrence is its own


def test_drafts_from_its_own_output_as_it_is_committed():
    prompt = [10, 11, 12]
    drafter = _started(prompt)
    seq = prompt + [20, 21, 22, 23, 24]
    drafter.commit(seq)
    assert _propose(drafter, seq, 4).tokens == []
    seq += [20, 21, 22]
    drafter.commit(seq)
    assert _propose(drafter, seq, 4).tokens == [23, 24, 20]  # what followed the tail 20 21 22: 3 tokens for 3
    seq += [23, 99]  # tokens propose sees before any commit are taken too
    assert _propose(drafter, seq + [20], 4).tokens == [21]


def test_the_more_frequent_continuation_wins():
    prompt = [1, 2, 5, 1, 2, 6, 1, 2, 6, 1, 2]
    assert _propose(_started(prompt), prompt, 1).tokens == [6]


def test_signals_name_the_match_its_count_and_each_tokens_probability():
    prompt = [1, 2, 3, 4, 8, 1, 2, 3, 5, 1, 2, 3]
    drafter = _started(prompt)
    assert drafter.signal_names == SUFFIX_SIGNALS == ("match_len", "count", "prob")
    seen = []
    draft = _propose(drafter, prompt, 3, stop=lambda i, signal: seen.append(signal) or False)
    assert draft.tokens == [5, 1, 2] and draft.signals == seen  # ties go to the latest seen
    assert draft.signals == [(3.0, 2.0, 0.5), (3.0, 2.0, 0.5), (3.0, 2.0, 0.5)]
    assert _propose(drafter, prompt, 3, stop=lambda i, signal: i == 1).tokens == [5, 1]
    assert _propose(drafter, prompt, 3).signals == []  # computed only for a stop rule


def test_a_finished_requests_output_drafts_for_the_next_request_of_the_same_engine():
    cache = SuffixCache()
    first = _started([100, 101], cache=cache)
    output = [1, 2, 3, 4, 5, 6, 7, 8]
    first.finish([100, 101] + output)
    assert first.learned() == (1, cache.trie.nbytes) and cache.trie.nbytes > 0
    second = _started([50, 1, 2, 3, 4], cache=cache)  # another slot's drafter, or the same one reset
    assert _propose(second, [50, 1, 2, 3, 4], 8).tokens == [5, 6, 7, 8]
    assert _propose(_started([50, 100, 101], cache=cache), [50, 100, 101], 8).tokens == []  # only outputs are kept


def test_a_drafter_sees_outputs_that_finish_while_it_runs():
    cache = SuffixCache()
    running = _started([7, 1, 2], cache=cache)
    assert _propose(running, [7, 1, 2], 4).tokens == []
    _started([9], cache=cache).finish([9, 1, 2, 3, 4])
    assert _propose(running, [7, 1, 2], 4).tokens == [3, 4]


def test_long_run_reports_a_long_sure_match_and_the_next_propose_drafts_it():
    text = list(range(100, 140))
    prompt = text + [1] + text[:10]
    drafter = _started(prompt, alpha=4.0)
    # The trie holds 32 tokens: the shortest long tail (8 tokens) leaves the most room, 24 tokens.
    assert drafter.long_run() == 24
    assert _propose(drafter, prompt, 30).tokens == text[10:34]
    assert drafter.long_run() == 24
    assert _propose(drafter, prompt, 5).tokens == text[10:15]
    short = prompt[:-(10 - LONG_MATCH + 1)]  # a match one token too short
    assert _started(short, alpha=4.0).long_run() == 0
    forked = text + [1] + text[:12] + [2] + text[:10]  # both went on with 2 tokens alike, then parted
    assert _started(forked, alpha=4.0).long_run() == 2


class _AlwaysSynced(SuffixDrafter):
    """The drafter as it was before long_run's first check: its tries follow every commit, every long run is
    looked up in them."""

    def commit(self, seq):
        super().commit(seq)
        self._sync(seq)

    def long_run(self):
        self._sync(self._latest)
        self._look_up([])
        pick = self._pick(max(self.max_depth, self.cache.max_depth), shortest=LONG_MATCH)
        run = 0 if pick is None else next((i for i, p in enumerate(pick.probs) if p < LONG_PROB), len(pick.probs))
        self._plan = pick if run else None
        return run


@pytest.mark.parametrize("seed", range(8))
def test_long_runs_and_drafts_are_those_of_tries_that_follow_every_commit(seed):
    # long_run first checks that the last LONG_MATCH tokens occurred before (in the request or in the cache) and
    # leaves the tries behind the sequence until asked: the same answers as tries kept in step, evictions included.
    import random

    rng = random.Random(seed)
    phrases = [[rng.randrange(50) for _ in range(rng.randrange(6, 14))] for _ in range(4)]
    lazy, eager = (cls(SuffixCache(max_requests=2)) for cls in (SuffixDrafter, _AlwaysSynced))
    for _ in range(4):  # requests, each finished into both caches
        seq = [t for _ in range(3) for t in rng.choice(phrases)]
        for drafter in (lazy, eager):
            drafter.reset(None, seq)
        for _ in range(40):
            seq = seq + (rng.choice(phrases)[:rng.randrange(1, 4)] if rng.random() < 0.7 else [rng.randrange(50)])
            for drafter in (lazy, eager):
                drafter.commit(seq)
            assert lazy.long_run() == eager.long_run()
            if rng.random() < 0.5:
                k = rng.randrange(1, 12)
                assert _propose(lazy, seq, k).tokens == _propose(eager, seq, k).tokens
        for drafter in (lazy, eager):
            drafter.finish(seq)
    assert lazy.cache.long_grams == eager.cache.long_grams
    kept = [h for out in lazy.cache.outputs for h in _hashes(out)]
    assert sorted(lazy.cache.long_grams.elements()) == sorted(kept)  # evicted outputs' grams left with them


def test_a_propose_past_the_last_commit_is_not_synced_back_by_a_long_run():
    # A caller that proposes without committing (a replay) and a cache that changes in between: the request's trie
    # must hold each token once, as a drafter committed to the same sequence does.
    text = list(range(100, 120))
    prompt = text + [1] + text[:9]
    replayed, committed = SuffixDrafter(SuffixCache()), SuffixDrafter(SuffixCache())
    for drafter in (replayed, committed):
        drafter.reset(None, prompt)
    seq = prompt + text[9:12]
    committed.commit(seq)
    for drafter in (replayed, committed):
        _propose(drafter, seq, 4)
        drafter.cache.add([7] * 10)  # the cache changes: the next long_run looks the tails up again
        drafter.long_run()
    assert replayed._trie.count([]) == committed._trie.count([]) == len(seq)
    assert _propose(replayed, seq, 6).tokens == _propose(committed, seq, 6).tokens


def _hashes(tokens: list[int]) -> list[int]:
    return [hash(tuple(tokens[i:i + LONG_MATCH])) for i in range(len(tokens) - LONG_MATCH + 1)]


def test_the_tree_variant_drafts_the_alternatives_seen():
    # After "1 2": 4 three times (each going on differently), 3 8 twice.
    prompt = [1, 2, 4, 5, 1, 2, 4, 6, 1, 2, 4, 7, 1, 2, 3, 8, 1, 2, 3, 8, 9, 1, 2]
    drafter = _started(prompt, tree=True, alpha=2.0)
    draft = _propose(drafter, prompt, 4)
    check_tree(draft.tokens, draft.parents)
    assert (draft.tokens, draft.parents) == ([4, 3, 8, 1], [-1, -1, 1, 2])  # path probabilities .6 .4 .4 .4
    assert drafter.signal_names == () and draft.signals == []
    assert _propose(drafter, prompt, 2).tokens == [4, 3]
    assert _propose(_started(prompt, tree=True), prompt, 4).tokens == [4, 3]  # ceil(alpha * 2) nodes
    assert _propose(_started(prompt, alpha=2.0), prompt, 4).tokens == [4, 7, 1, 2]  # the chain: the latest 4


def test_the_cache_evicts_the_oldest_past_either_bound():
    cache = SuffixCache(max_requests=2)
    for output in ([1, 2], [3, 4], [5, 6]):
        cache.add(output)
    assert list(cache.outputs) == [[3, 4], [5, 6]] and cache.trie.count([1, 2]) == 0 and cache.trie.count([3]) == 1
    node_bytes = SuffixCache().trie.node_bytes
    by_bytes = SuffixCache(max_bytes=6 * node_bytes)  # 3 nodes an output of 2 tokens
    for output in ([1, 2], [3, 4], [5, 6]):
        by_bytes.add(output)
    assert list(by_bytes.outputs) == [[3, 4], [5, 6]] and by_bytes.learned() == (2, 6 * node_bytes)
    by_bytes.add(list(range(10, 20)))  # alone past the bound: it goes too
    assert by_bytes.learned() == (0, 0)


def test_the_cache_can_be_off():
    cache = SuffixCache(enabled=False)
    drafter = _started([5], cache=cache)
    drafter.finish([5, 1, 2, 3])
    assert drafter.learned() == (0, 0)
    assert _propose(_started([1, 2], cache=cache), [1, 2], 4).tokens == []


def test_drafters_built_from_one_inputs_share_a_cache_and_others_do_not():
    inputs = DrafterInputs(target=None)
    a, b = registry.build("suffix", inputs), registry.build("suffix", inputs)
    c = registry.build("suffix", DrafterInputs(target=None))
    assert a.cache is b.cache and a.cache is not c.cache
    assert registry.spec("suffix").learns and registry.spec("suffix-tree").tree
    assert registry.names_where(lambda spec: spec.learns) == ("suffix", "suffix-tree", "auto")  # what needs the cache
    assert registry.build("suffix-tree", inputs).cache is a.cache


@pytest.mark.parametrize("kwargs, message", [(dict(alpha=0.0), "alpha > 0"), (dict(min_prob=1.5), "min_prob <= 1")])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SuffixDrafter(**kwargs)


@pytest.mark.usefixtures("one_thread")
def test_an_engine_drafts_a_repeated_request_from_its_first_output():
    inputs = DrafterInputs(target=varied_model(0))
    engine = BatchEngine(inputs.target, new_drafter=lambda: registry.build("suffix", inputs),
                         spec=SpeculativeConfig(gamma=4), scheduler=SchedulerConfig(max_running=3), max_len=96)
    first = engine.run(requests())
    assert engine.learned[0] == len(first)
    second = engine.run(requests())
    assert [r.token_ids for r in second] == [r.token_ids for r in first]
    assert sum(r.stats.accepted_tokens for r in second) > sum(r.stats.accepted_tokens for r in first)


def test_a_forgotten_cache_drafts_nothing_it_learnt_and_a_running_drafter_looks_again():
    cache = SuffixCache()
    running = _started([7, 1, 2], cache=cache)
    _started([9], cache=cache).finish([9, 1, 2, 3, 4])
    assert _propose(running, [7, 1, 2], 4).tokens == [3, 4] and cache.long_grams == {} and cache.learned()[0] == 1
    _started([9], cache=cache).finish([9] + list(range(20, 30)))
    running.forget()  # any slot's drafter: the cache is the engine's
    assert cache.learned() == (0, cache.trie.nbytes) and not cache.long_grams and not cache.outputs
    assert _propose(running, [7, 1, 2], 4).tokens == []
    _started([9], cache=cache).finish([9, 1, 2, 5])  # and it learns again
    assert _propose(running, [7, 1, 2], 4).tokens == [5]


def test_an_engine_forgets_what_it_learnt_when_idle():
    inputs = DrafterInputs(target=varied_model(0))
    engine = BatchEngine(inputs.target, new_drafter=lambda: registry.build("suffix", inputs),
                         spec=SpeculativeConfig(gamma=4), scheduler=SchedulerConfig(max_running=3), max_len=96)
    first = engine.run(requests())
    taught = engine.run(requests())  # drafted from the first run's outputs
    engine.forget_learned()
    assert engine.learned[0] == 0
    again = engine.run(requests())  # from nothing earlier (but each other's outputs as they finish)
    assert [r.token_ids for r in again] == [r.token_ids for r in taught] == [r.token_ids for r in first]
    accepted = [sum(r.stats.accepted_tokens for r in run) for run in (first, taught, again)]
    assert accepted[2] < accepted[1] and abs(accepted[2] - accepted[0]) < accepted[1] - accepted[0], accepted
    engine.submit(**requests()[0])
    with pytest.raises(RuntimeError, match="idle"):
        engine.forget_learned()


def test_the_warm_up_teaches_the_cache_nothing_and_gamma_zero_drafts_nothing():
    inputs = DrafterInputs(target=varied_model(0))
    engine = BatchEngine(inputs.target, new_drafter=lambda: registry.build("suffix", inputs),
                         spec=SpeculativeConfig(gamma=4), scheduler=SchedulerConfig(max_running=2), max_len=96)
    engine.warmup()
    assert engine.learned == (0, 0)
    engine.run(requests()[:2])
    assert engine.learned[0] == 2 and engine.learned[1] > 0
    off = BatchEngine(inputs.target, new_drafter=lambda: registry.build("suffix", inputs),
                      spec=SpeculativeConfig(gamma=0), max_len=96)
    results = off.run(requests()[:2] * 2)  # the shared cache knows these answers: still, gamma 0 drafts nothing
    assert sum(r.stats.drafted_tokens for r in results) == 0
