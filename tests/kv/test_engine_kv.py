"""The engine over compressed and shared caches, on tiny random models: greedy speculation is token-identical
to greedy plain decoding under the same cache setting for every drafter; prefix hits reproduce cold runs;
window memory stays flat; KV bytes reach the stats; the budget is enforced."""

from __future__ import annotations

import pytest

from specdecode.drafters import DraftModelDrafter, LayerSkipDrafter, NgramDrafter, NgramTreeDrafter
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.kv.cache import CacheConfig
from specdecode.kv.memory import KVBudgetError
from specdecode.models.transformer import Transformer
from tiny_models import OracleTreeDrafter, varied_model

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 40
PROMPTS = [
    [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8],  # repetitive: n-gram lookup proposes from the start
    [90, 3, 17, 44, 2, 60, 5, 71, 33, 12, 19, 64],
]
SETTINGS = {
    "bfloat16": CacheConfig(kv_dtype="bfloat16"),
    "int8": CacheConfig(kv_dtype="int8", group_size=4, residual=4, prefill_chunk=8),
    "int4": CacheConfig(kv_dtype="int4", group_size=4, residual=2, prefill_chunk=8),
    "window": CacheConfig(window=6, sinks=2, evict_chunk=3, prefill_chunk=8),
    "int8-window": CacheConfig(kv_dtype="int8", window=10, sinks=1, group_size=4, residual=4, prefill_chunk=8),
    "prefix": CacheConfig(prefix_cache=True, prefill_chunk=4),
    "int4-window-prefix": CacheConfig(kv_dtype="int4", window=12, sinks=2, group_size=2, residual=4,
                                      prefix_cache=True, prefill_chunk=4),
}
# Settings whose compression changes the greedy output of these prompts (so they are really in effect).
LOSSY = ("int4", "window", "int8-window", "int4-window-prefix")


@pytest.fixture(scope="module")
def target() -> Transformer:
    return varied_model(0)


@pytest.fixture(scope="module")
def draft_model() -> Transformer:
    return varied_model(0, keep_layers=[0, 1])  # the target truncated: agrees often, not always


def _drafter(kind: str, target: Transformer, draft_model: Transformer, cache: CacheConfig):
    if kind == "ngram":
        return NgramDrafter()
    if kind == "draft":
        return DraftModelDrafter(draft_model, target, cache)
    return LayerSkipDrafter(target, [1])


@pytest.fixture(scope="module")
def uncompressed(target) -> list[list[int]]:
    return [Engine(target).generate(p, max_new_tokens=NEW_TOKENS).token_ids for p in PROMPTS]


@pytest.mark.parametrize("setting", SETTINGS)
def test_greedy_speculation_equals_plain_decoding_under_the_same_cache_setting(target, draft_model, uncompressed,
                                                                              setting):
    cache = SETTINGS[setting]
    plain_engine = Engine(target, cache=cache)
    plain = [plain_engine.generate(p, max_new_tokens=NEW_TOKENS).token_ids for p in PROMPTS]
    if setting in LOSSY:
        assert plain != uncompressed
    for kind in ("ngram", "draft", "layerskip"):
        accepted = 0
        for gamma in (4, "agreement"):
            engine = Engine(target, drafter=_drafter(kind, target, draft_model, cache),
                            spec=SpeculativeConfig(gamma=gamma, gamma_max=6), cache=cache)
            for _ in range(2):  # the second round reuses the engine (and its prefix caches)
                for prompt, want in zip(PROMPTS, plain):
                    result = engine.generate(prompt, max_new_tokens=NEW_TOKENS)
                    assert result.token_ids == want, (setting, kind, gamma, prompt)
                    accepted += result.stats.accepted_tokens
            assert all(tree.referenced == 0 for tree in engine.memory.prefixes.values())
        assert accepted > 0, (setting, kind)  # drafts were really verified


@pytest.mark.parametrize("setting", SETTINGS)
def test_tree_paths_are_moved_into_place_under_every_cache_setting(target, setting):
    """Trees whose accepted paths leave the first branch (``OracleTreeDrafter``), and ngram-tree's, keep greedy
    output equal to plain decoding under the same cache setting: the path's rows are moved into place in
    full precision before anything is compressed, evicted or shared."""
    cache = SETTINGS[setting]
    plain_engine = Engine(target, cache=cache)
    plain = [plain_engine.generate(p, max_new_tokens=NEW_TOKENS).token_ids for p in PROMPTS]
    oracle = OracleTreeDrafter({tuple(p): want for p, want in zip(PROMPTS, plain)}, target.config.vocab_size)
    trees = 0
    for drafter, gamma in ((oracle, 5), (NgramTreeDrafter(), 4)):
        engine = Engine(target, drafter=drafter, spec=SpeculativeConfig(gamma=gamma), cache=cache)
        for _ in range(2):  # the second round reuses the engine (and its prefix caches)
            for prompt, want in zip(PROMPTS, plain):
                result = engine.generate(prompt, max_new_tokens=NEW_TOKENS)
                assert result.token_ids == want, (setting, drafter.name, prompt)
                if drafter is oracle:
                    trees += result.stats.tree_steps
                    assert result.stats.accepted_tokens >= result.stats.tree_steps
    # Quantized windows compress every 1-2 tokens here, so no draft holds two nodes (stable_rows).
    assert trees > 0 or setting in ("int8-window", "int4-window-prefix")


def test_a_prefix_hit_gives_the_output_of_a_cold_cache_for_target_and_draft(target, draft_model):
    cache = CacheConfig(prefix_cache=True, prefill_chunk=4, kv_dtype="int8", group_size=4, residual=4)
    shared = [(13 * i + 2) % 97 for i in range(14)]
    first, second = shared + [1, 2, 3], shared + [50, 60, 70, 80, 90]

    def engine() -> Engine:
        return Engine(target, drafter=DraftModelDrafter(draft_model, target, cache), spec=SpeculativeConfig(gamma=3),
                      cache=cache)

    warm = engine()
    assert warm.generate(first, max_new_tokens=NEW_TOKENS).stats.prefix_hit_tokens == 0
    got = warm.generate(second, max_new_tokens=NEW_TOKENS)
    assert got.stats.prefix_hit_tokens == 12
    cold = engine().generate(second, max_new_tokens=NEW_TOKENS)
    assert cold.stats.prefix_hit_tokens == 0
    assert got.token_ids == cold.token_ids and got.stats.accepted_tokens > 0
    trees = warm.memory.prefixes
    assert {key[0] for key in trees} == {target, draft_model}  # the draft model's cache is shared too
    draft_tree = next(t for key, t in trees.items() if key[0] is draft_model)
    assert draft_tree.tokens == 16 + 2  # first's 16 prefilled tokens; second's 16 share 14 of them
    assert all(t.referenced == 0 for t in trees.values())


def test_generation_far_past_the_window_keeps_memory_flat_and_stays_identical(target):
    cache = CacheConfig(window=8, sinks=2, evict_chunk=4, prefill_chunk=8)
    prompt = PROMPTS[1]
    plain = Engine(target, cache=cache)
    spec = Engine(target, drafter=NgramDrafter(), spec=SpeculativeConfig(gamma=4), cache=cache)
    short, long = plain.generate(prompt, max_new_tokens=60), plain.generate(prompt, max_new_tokens=400)
    assert long.token_ids[:60] == short.token_ids
    assert spec.generate(prompt, max_new_tokens=400).token_ids == long.token_ids
    per_token = plain.cache.bytes_per_token
    for result in (short, long):
        assert result.stats.kv_bytes <= (2 + 8 + 4) * per_token
    assert long.stats.kv_bytes_per_token < short.stats.kv_bytes_per_token / 4
    small = Engine(target, cache=cache)
    small.generate(prompt, max_new_tokens=8)
    assert small.cache.max_len < plain.cache.max_len and small.cache.nbytes == plain.cache.nbytes


def test_kv_bytes_in_the_stats(target, draft_model):
    prompt, n = PROMPTS[1], 120
    per_token = {}
    for name, cache in {"auto": CacheConfig(), "int8": CacheConfig(kv_dtype="int8", group_size=16, residual=8),
                        "int4": CacheConfig(kv_dtype="int4", group_size=16, residual=8)}.items():
        stats = Engine(target, cache=cache).generate(prompt, max_new_tokens=n).stats
        held = len(prompt) + n - 1
        assert stats.kv_bytes_per_token == pytest.approx(stats.kv_bytes / held)
        per_token[name] = stats.kv_bytes_per_token
        assert stats.draft_kv_bytes == 0 and stats.draft_kv_bytes_per_token == 0.0
    assert per_token["auto"] == 2 * 4 * 2 * 16 * 4  # k + v, 4 layers, 2 heads of 16, float32
    # Scales weigh a lot with heads of 16 (float32 scale + zero per 16 channels), and recent tokens stay in
    # full precision: int8 still holds this sequence in less than half the bytes.
    assert per_token["int4"] < per_token["int8"] < per_token["auto"] / 2
    for kind in ("ngram", "layerskip"):  # layerskip writes into the target's cache: no memory of its own
        stats = Engine(target, drafter=_drafter(kind, target, draft_model, CacheConfig())).generate(
            prompt, max_new_tokens=8).stats
        assert stats.draft_kv_bytes == 0 and stats.kv_bytes > 0
    engine = Engine(target, drafter=DraftModelDrafter(draft_model, target, CacheConfig(kv_dtype="int8")))
    stats = engine.generate(prompt, max_new_tokens=8).stats
    draft_cache = engine.memory.caches["draft-0"]  # the drafter's cache, named by its slot
    assert engine.drafter.cache is draft_cache and draft_cache.config.kv_dtype == "int8"
    assert stats.draft_kv_bytes == draft_cache.bytes_used(0) > 0
    assert stats.draft_kv_bytes_per_token == stats.draft_kv_bytes / draft_cache.lengths[0]
    assert {"kv_bytes", "kv_bytes_per_token", "draft_kv_bytes", "draft_kv_bytes_per_token",
            "prefix_hit_tokens"} <= set(stats.to_dict())


def test_a_request_that_does_not_fit_the_budget_fails_before_any_allocation(target, draft_model):
    engine = Engine(target, cache=CacheConfig(budget=300_000))
    held = engine.cache
    # 12 prompt tokens + 200 new ones + a step's rows (a long draft's 64, SpeculativeConfig.long_max): slots of 320
    # tokens, 1,024 bytes each.
    with pytest.raises(KVBudgetError, match=r"the target cache for 320 tokens per sequence \(auto\) needs 327,680 "
                                            r"bytes .* the budget is 300,000 bytes"):
        engine.generate(PROMPTS[1], max_new_tokens=200)
    assert engine.cache is held and set(engine.memory.caches) == {"target"}  # the smaller cache is kept
    assert len(engine.generate(PROMPTS[1], max_new_tokens=8).token_ids) == 8  # and still serves what fits
    # int8 fits the same budget.
    assert len(Engine(target, cache=CacheConfig(budget=300_000, kv_dtype="int8")).generate(
        PROMPTS[1], max_new_tokens=200).token_ids) == 200
    # The target fits, the draft model's cache does not.
    both = Engine(target, drafter=DraftModelDrafter(draft_model, target), cache=CacheConfig(budget=400_000))
    with pytest.raises(KVBudgetError, match=r"the draft-0 cache .* the target cache 327,680 bytes"):
        both.generate(PROMPTS[1], max_new_tokens=200)


def test_prefix_caches_stay_within_the_budget_across_requests(target):
    budget = 300_000
    engine = Engine(target, cache=CacheConfig(budget=budget, prefix_cache=True, prefill_chunk=4))
    for i in range(6):
        prompt = [(i * 31 + j * 7) % 97 for j in range(40)]
        engine.generate(prompt, max_new_tokens=4)
        assert engine.memory.nbytes <= budget
    assert engine.memory.prefix_bytes > 0  # some prefixes were kept, others evicted to stay within budget
    assert engine.memory.prefix_bytes < 6 * 40 * 1024
