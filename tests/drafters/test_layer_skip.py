"""Self-speculation by skipping layers: layer lists, cache hygiene, skip-set calibration."""

from __future__ import annotations

import pytest
import torch

from specdecode.drafters import DrafterInputs, registry
from specdecode.drafters.layer_skip import (Calibration, LayerSkipDrafter, block_influence, calibrate_skip_set,
                                            parse_layers)
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import from_hf_tensors
from specdecode.models.rows import LogitRows
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams
from specdecode.stats import predicted_speedup
from tiny_models import random_hf_tensors, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> Transformer:
    config = tiny_config("llama")
    return from_hf_tensors(config, random_hf_tensors(config, 0, scale=0.2))


# --------------------------------------------------------------------------- parse_layers


@pytest.mark.parametrize("spec, want", [
    ("1,3-5", (1, 3, 4, 5)),
    ("7", (7,)),
    (" 2 , 0 ,2", (0, 2)),
    ("0-2,1-3", (0, 1, 2, 3)),
    ("", ()),
    ("4,", (4,)),
])
def test_parse_layers(spec, want):
    assert parse_layers(spec, 8) == want


@pytest.mark.parametrize("spec, message", [
    ("1,8", r"layers \[8\] are out of range 0\.\.7"),
    ("6-9", r"layers \[8, 9\] are out of range 0\.\.7"),
    ("-1", r"'-1' is not a number or a range like 3-7"),
    ("a", r"'a' is not a number or a range like 3-7"),
    ("1-x", r"'1-x' is not a number or a range like 3-7"),
    ("1.5", r"'1\.5' is not a number"),
])
def test_parse_layers_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_layers(spec, 8)


# --------------------------------------------------------------------------- the drafter


@pytest.mark.parametrize("skip", [[0, 1, 2, 3], [0, 1, 2, 3, 3], [4], [-1], [1, 4]])
def test_refuses_skipping_all_or_unknown_layers(model, skip):
    with pytest.raises(ValueError, match=r"must name some but not all of layers 0\.\.3"):
        LayerSkipDrafter(model, skip)


def test_layers_run_are_the_complement(model):
    d = LayerSkipDrafter(model, [3, 1, 1])
    assert d.skip == (1, 3) and d.layers == (0, 2)


def test_the_registry_builds_layerskip(model):
    with pytest.raises(ValueError, match="needs a set of layers to skip"):
        registry.build("layerskip", DrafterInputs(target=model))
    d = registry.build("layerskip", DrafterInputs(target=model, skip_layers=(2,)))
    assert isinstance(d, LayerSkipDrafter) and d.skip == (2,) and d.model is model


def _skip_logits(model: Transformer, seq: list[int], layers) -> torch.Tensor:
    cache = model.new_cache(CacheConfig(max_len=len(seq)))
    return model(torch.tensor([seq]), cache, layers=layers, logits=LogitRows.LAST).logits[0, -1]


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0)], ids=["greedy", "sampled"])
def test_propose_leaves_target_cache_as_found(model, sampling):
    seq = [5, 17, 29, 41, 53, 65]
    target_cache = model.new_cache(CacheConfig(max_len=32))
    model(torch.tensor([seq[:-1]]), target_cache, logits=LogitRows.NONE)  # the engine's state: all but the last token
    saved = [k[0, :, :5].clone() for k in target_cache.k]

    drafter = LayerSkipDrafter(model, [1, 2])
    drafter.reset(target_cache)
    draft = drafter.propose(seq, 4, sampling, torch.Generator().manual_seed(0))
    assert len(draft.tokens) == 4
    assert target_cache.lengths == [5]
    for before, k in zip(saved, target_cache.k):
        assert torch.equal(k[0, :, :5], before)  # verified entries untouched
    if sampling.greedy:
        assert draft.q is None
        # The draft is the greedy continuation of the skipping model reading the full model's keys/values
        # for the verified prefix (the shared cache), recomputed here on a separate cache.
        ref_cache = model.new_cache(CacheConfig(max_len=32))
        model(torch.tensor([seq[:-1]]), ref_cache, logits=LogitRows.NONE)
        fed = seq[-1]
        for token in draft.tokens:
            logits = model(torch.tensor([[fed]]), ref_cache, layers=drafter.layers, logits=LogitRows.LAST).logits[0, -1]
            assert token == int(logits.argmax())
            fed = token
    else:
        assert draft.q.shape == (4, model.config.vocab_size)
        torch.testing.assert_close(draft.q.sum(-1), torch.ones(4))

    # Verification right after drafting sees exactly what a clean cache would.
    verify = model(torch.tensor([seq[-1:] + draft.tokens]), target_cache).logits
    clean = model.new_cache(CacheConfig(max_len=32))
    want = model(torch.tensor([seq + draft.tokens]), clean).logits[:, len(seq) - 1:]
    torch.testing.assert_close(verify, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("config", [CacheConfig(max_len=32), CacheConfig(max_len=32, kv_dtype="int8", group_size=2,
                                                                          residual=1, prefill_chunk=8)],
                         ids=["plain", "int8"])
def test_drafting_never_touches_the_skipped_layers_entries(model, config):
    """The drafter writes K/V only for the layers it runs (and only past the verified tokens); the skipped
    layers' buffers stay bitwise as they were, whatever the cache kind."""
    seq = [5, 17, 29, 41, 53, 65, 77, 89]
    target_cache = model.new_cache(config)
    target_cache.commit(0, len(seq) - 1)
    model(torch.tensor([seq[:-1]]), target_cache, logits=LogitRows.NONE)
    buffers = (lambda c: c.k + c.v) if hasattr(target_cache, "k") else (lambda c: c.fp_k + c.fp_v + c.k_codes + c.v_codes)
    saved = [b.clone() for b in buffers(target_cache)]
    drafter = LayerSkipDrafter(model, [1, 3])
    drafter.reset(target_cache)
    drafter.propose(seq, 4, SamplingParams(), torch.Generator())
    n = model.config.num_layers
    after = buffers(target_cache)
    for i, (before, now) in enumerate(zip(saved, after)):
        layer = i % n
        if layer in drafter.skip:
            assert torch.equal(before, now), layer
    assert any(not torch.equal(b, a) for i, (b, a) in enumerate(zip(saved, after)) if i % n in drafter.layers)
    assert target_cache.lengths == [len(seq) - 1] and target_cache.committed == [len(seq) - 1]


# --------------------------------------------------------------------------- calibration


def test_calibrate_skip_set(model):
    prompts = [[1, 2, 3, 4, 5], [60, 61, 62, 63]]
    new_tokens, gamma, verify_cost = 12, 4, 1.1
    lines = []
    cal = calibrate_skip_set(model, prompts, new_tokens=new_tokens, gamma=gamma, verify_cost=verify_cost,
                             progress=lines.append)
    n = model.config.num_layers
    assert isinstance(cal, Calibration) and cal.gamma == gamma
    assert 1 <= len(cal.skip) < n and list(cal.skip) == sorted(set(cal.skip))
    assert all(0 <= i < n for i in cal.skip)
    assert 0.0 <= cal.agreement <= 1.0
    assert cal.predicted_speedup == pytest.approx(
        predicted_speedup(cal.agreement, gamma, (n - len(cal.skip)) / n, verify_cost))

    # The reported agreement is recomputed here from its definition.
    layers = [i for i in range(n) if i not in cal.skip]
    hits = total = 0
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(new_tokens):
            full_next = int(_skip_logits(model, seq, None).argmax())
            hits += int(_skip_logits(model, seq, layers).argmax()) == full_next
            total += 1
            seq.append(full_next)
    assert cal.agreement == pytest.approx(hits / total)

    # History: nested skip sets growing one layer at a time; the result is the best-scoring entry.
    assert len(lines) == len(cal.history) >= 1
    assert (cal.skip, cal.agreement, cal.predicted_speedup) == max(cal.history, key=lambda h: h[2])
    for i, (skip, a, s) in enumerate(cal.history):
        assert len(skip) == i + 1 and 0.0 <= a <= 1.0
        assert s == pytest.approx(predicted_speedup(a, gamma, (n - len(skip)) / n, verify_cost))
        if i:
            assert set(cal.history[i - 1][0]) < set(skip)
    # It stops once agreement drops below the floor, or after trying every size.
    assert cal.history[-1][1] < 0.3 or len(cal.history) == n - 1


def test_calibration_on_layers_that_do_nothing_skips_them():
    """Layers with zero output projections are identities: skipping them keeps agreement at 1."""
    config = tiny_config("llama")
    tensors = random_hf_tensors(config, 0, scale=0.2)
    for i in (1, 2):
        tensors[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
        tensors[f"model.layers.{i}.mlp.down_proj.weight"].zero_()
    model = from_hf_tensors(config, tensors)
    cal = calibrate_skip_set(model, [[1, 2, 3], [40, 50]], new_tokens=8)
    assert set(cal.skip) >= {1, 2}
    # Identity layers have zero block influence, so they are the first two skipped, at full agreement.
    assert [h[0] for h in cal.history][:2] in ([(1,), (1, 2)], [(2,), (1, 2)])
    assert cal.history[1][1] == 1.0


def test_block_influence_is_zero_for_identity_layers(model):
    config = tiny_config("llama")
    tensors = random_hf_tensors(config, 0, scale=0.2)
    tensors["model.layers.2.self_attn.o_proj.weight"].zero_()
    tensors["model.layers.2.mlp.down_proj.weight"].zero_()
    influence = block_influence(from_hf_tensors(config, tensors), [[1, 2, 3, 4], [9, 8]])
    assert influence[2] == pytest.approx(0.0, abs=1e-6)
    assert min(x for i, x in enumerate(influence) if i != 2) > 1e-3


def test_parse_layers_rejects_a_backwards_range():
    with pytest.raises(ValueError, match="runs backwards"):
        parse_layers("3-1", 8)
