"""The trained-head drafters (EAGLE, Medusa) with random heads on a tiny model: greedy output identical to
plain decoding on every cache setting, the features they are handed line up with the sequence, and a
prefix-cache hit (no features for the reused prefix) is handled."""

from __future__ import annotations

import pytest
import torch

from specdecode.drafters import DrafterInputs, registry
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import pack_model
from specdecode.models.linear import QuantLinear
from specdecode.sampling import SamplingParams
from kernel_paths import NATIVE_PATHS, path_params
from tiny_models import random_head_drafter, varied_model, write_head_file

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = list(range(5, 40))
CACHES = {"plain": CacheConfig(), "int8": CacheConfig(kv_dtype="int8"), "int4": CacheConfig(kv_dtype="int4"),
          "window": CacheConfig(window=24, sinks=4), "prefix": CacheConfig(prefix_cache=True)}


@pytest.fixture(scope="module")
def target():
    return varied_model(0)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
@pytest.mark.parametrize("gamma", [3, "adaptive"])
def test_greedy_output_is_identical_to_plain_decoding(target, kind, cache, gamma):
    config = CACHES[cache]
    plain = Engine(target, cache=config).generate(PROMPT, max_new_tokens=40, eos_token_ids=()).token_ids
    drafter = random_head_drafter(kind, target, vocab=range(0, 97, 2), seed=1, cache=config)
    engine = Engine(target, drafter=drafter, spec=SpeculativeConfig(gamma=gamma), cache=config)
    for _ in range(2):  # the second request may hit the prefix cache
        result = engine.generate(PROMPT, max_new_tokens=40, eos_token_ids=())
        assert result.token_ids == plain
    assert result.stats.drafted_tokens > 0 or gamma == "adaptive"


def test_bf16_packed_target_keeps_greedy_identity(target):
    model = varied_model(0, dtype=torch.bfloat16)
    path = pack_model(model, "auto").name
    plain = Engine(model).generate(PROMPT, max_new_tokens=32, eos_token_ids=()).token_ids
    for kind in ("eagle", "eagle3", "medusa"):
        engine = Engine(model, drafter=random_head_drafter(kind, model, seed=2), spec=SpeculativeConfig(gamma=4))
        result = engine.generate(PROMPT, max_new_tokens=32, eos_token_ids=())
        assert result.token_ids == plain, (kind, path)
        assert result.stats.drafted_tokens > 0


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
def test_a_block_format_target_gets_a_q8_0_head_scoring_with_its_own_head_blocks(path):
    model = varied_model(0, dtype=torch.bfloat16)
    pack_model(model, path, weights="q4_1")
    plain = Engine(model).generate(PROMPT, max_new_tokens=32, eos_token_ids=()).token_ids
    drafter = random_head_drafter("eagle", model, vocab=range(0, 97, 2), seed=2)
    assert isinstance(drafter.head.fc, QuantLinear) and drafter.head.fc.weight_format == "q8_0"
    ids = torch.arange(0, 97, 2)
    head_rows = model.head_layer.weight_rows(ids)
    assert torch.equal(drafter.vocab.linear.weight_rows(torch.arange(len(ids))), head_rows)
    result = Engine(model, drafter=drafter, spec=SpeculativeConfig(gamma=4)).generate(
        PROMPT, max_new_tokens=32, eos_token_ids=())
    assert result.token_ids == plain
    assert result.stats.drafted_tokens > 0


class Spy:
    """Wraps a drafter and records what the engine hands it."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []
        self.name, self.signal_names, self.feature_layers = inner.name, inner.signal_names, inner.feature_layers
        self.weight_nbytes = inner.weight_nbytes

    @property
    def own_cache(self):
        return self.inner.own_cache

    def name_cache(self, name):
        self.inner.name_cache(name)

    def reset(self, *args, **kwargs):
        self.seen.clear()
        self.inner.reset(*args, **kwargs)

    def observe(self, position, features):
        self.seen.append((position, features.shape[0]))
        self.inner.observe(position, features)

    def propose(self, seq, k, *args):
        # Every position before the newest token has been observed, exactly once and in order.
        covered = sum(n for _, n in self.seen)
        assert self.seen[0][0] + covered == len(seq) - 1, (self.seen, len(seq))
        return self.inner.propose(seq, k, *args)

    def commit(self, seq):
        self.inner.commit(seq)

    def long_run(self):
        return self.inner.long_run()

    def finish(self, seq):
        self.inner.finish(seq)


def test_features_cover_each_verified_position_once_in_order(target):
    spy = Spy(random_head_drafter("eagle", target, seed=3))
    engine = Engine(target, drafter=spy, spec=SpeculativeConfig(gamma=3))
    engine.generate(PROMPT, max_new_tokens=30, eos_token_ids=())
    positions = [p for p, _ in spy.seen]
    assert positions[0] == 0 and positions == sorted(positions)
    for (p, n), (q, _) in zip(spy.seen, spy.seen[1:]):
        assert q == p + n


def test_features_are_the_targets_normed_final_state(target):
    """What a head drafter is handed after prefill is the target's own normed state of the prompt."""
    spy = Spy(random_head_drafter("medusa", target, seed=4))
    got = []
    spy.observe = lambda position, features: got.append(features)  # noqa: E731 - capture only
    Engine(target, drafter=spy, spec=SpeculativeConfig(gamma=0)).generate(PROMPT, max_new_tokens=1, eos_token_ids=())
    cache = target.new_cache(CacheConfig(max_len=64))
    hidden = target(torch.tensor([PROMPT[:-1]]), cache, features=(target.config.num_layers,)).features
    assert torch.equal(got[0], hidden[0])


def test_eagle_drafter_refuses_features_out_of_order(target):
    drafter = random_head_drafter("eagle", target)
    drafter.reset(target.new_cache(CacheConfig(max_len=64)))
    drafter.observe(0, torch.zeros(3, 64))
    with pytest.raises(RuntimeError, match="features for position 5 arrived, expected 3"):
        drafter.observe(5, torch.zeros(1, 64))


def test_the_registry_reads_head_files_and_checks_the_kind(tmp_path, target):
    path = write_head_file(tmp_path / "m.safetensors", "medusa", target)
    assert registry.build("medusa", DrafterInputs(target=target, head=path)).name == "medusa"
    with pytest.raises(ValueError, match="is a medusa head, not a eagle head"):
        registry.build("eagle", DrafterInputs(target=target, head=path))
    with pytest.raises(ValueError, match="needs a head file"):
        registry.build("eagle", DrafterInputs(target=target))


def test_sampled_drafts_carry_their_distribution(target):
    drafter = random_head_drafter("eagle", target, vocab=[1, 2, 3], seed=5)
    drafter.reset(target.new_cache(CacheConfig(max_len=64)))
    drafter.observe(0, torch.randn(len(PROMPT) - 1, 64))
    draft = drafter.propose(PROMPT, 3, SamplingParams(temperature=1.0, seed=0), torch.Generator().manual_seed(0))
    assert len(draft.tokens) == 3 and draft.q.shape == (3, 97)
    assert torch.allclose(draft.q.sum(-1), torch.ones(3)) and draft.q[:, [0, *range(4, 97)]].max() == 0
    assert all(t in (1, 2, 3) for t in draft.tokens)


def test_drafting_over_the_draft_vocabulary_alone_picks_and_signals_as_the_whole_row(target):
    """A chain drafts from the draft vocabulary's own logits: the greedy pick (ties included), the sampled q
    and the confidence signals equal those of the whole row with -inf outside it."""
    from specdecode.drafters.base import confidence, draw
    from specdecode.heads.vocab import VocabHead

    vocab = VocabHead(target, torch.tensor([3, 8, 20, 41, 77]))
    small = torch.tensor([0.5, 2.0, -1.0, 2.0, 0.25])  # a tie: the lower id wins either way
    whole = vocab.full(small)
    greedy = SamplingParams(temperature=0.0)
    assert draw(small, greedy, torch.Generator(), vocab) == draw(whole, greedy, torch.Generator()) == (8, None)
    sampled = SamplingParams(temperature=0.7, top_k=3)
    token, q = draw(small, sampled, torch.Generator().manual_seed(1), vocab)
    same_token, same_q = draw(whole, sampled, torch.Generator().manual_seed(1))
    assert token == same_token and torch.equal(q, same_q) and q.shape == (97,)
    assert confidence(small) == pytest.approx(confidence(whole), rel=1e-6)
