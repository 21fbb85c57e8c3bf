"""DrafterConfig as Python callers build it: unknown kinds and settings a kind does not use are refused."""

from __future__ import annotations

import re

import pytest

from specdecode.drafter_setup import FLAG_FIELDS, PLAIN, DrafterConfig, drafter_factory
from specdecode.drafters import DrafterSpec, Needs, NgramDrafter, registry
from specdecode.drafters.suffix import SuffixCache
from specdecode.kv.cache import CacheConfig
from specdecode.target import TargetConfig
from tiny_models import write_tiny_hf_model


def test_a_drafter_config_names_what_is_wrong():
    with pytest.raises(ValueError, match="unknown drafter 'warp'; expected none \\(plain decoding\\) or one of ngram, "):
        DrafterConfig(kind="warp")
    with pytest.raises(ValueError, match="--drafter draft-tree needs --draft-model"):
        DrafterConfig(kind="draft-tree")
    with pytest.raises(ValueError, match=re.escape("--tree-width is only used by --drafter draft-tree|eagle-tree, not eagle")):
        DrafterConfig(kind="eagle", tree_width=2)


@pytest.mark.parametrize("config, own_cache", [
    (DrafterConfig(), False), (DrafterConfig("layerskip"), False), (DrafterConfig("medusa"), False),
    (DrafterConfig("eagle-tree", tree_width=2), True), (DrafterConfig("draft", draft_model="d"), True),
    (DrafterConfig("auto"), False), (DrafterConfig("auto", draft_model="d"), True),
])
def test_only_draft_models_and_eagle_heads_keep_a_cache(config, own_cache):
    assert config.has_draft_cache == own_cache


def test_auto_drafts_with_a_draft_model_only_when_given_one(tmp_path):
    with pytest.raises(ValueError, match="--draft-weights sets the draft model, which needs --draft-model"):
        DrafterConfig("auto", draft_weights="q8_0")
    assert not DrafterConfig("auto").uses_draft_model and DrafterConfig("auto", draft_model="d").uses_draft_model
    target_config = TargetConfig(str(write_tiny_hf_model(tmp_path / "t")), dtype="float32", device="cpu")
    target = target_config.load()
    said = []
    free = drafter_factory(DrafterConfig("auto"), target_config, target, CacheConfig(), said.append)()
    assert free.name == "auto" and free.model is None and not any("draft model" in line for line in said)
    config = DrafterConfig("auto", draft_model=str(write_tiny_hf_model(tmp_path / "d", seed=1)))
    drafter = drafter_factory(config, target_config, target, CacheConfig(), said.append)()
    assert drafter.name == "auto+draft" and drafter.model is not None and drafter.weight_nbytes > 0
    assert any(line.startswith("loading draft model") for line in said)


def test_plain_decoding_is_a_choice_but_no_drafter(tmp_path):
    config = DrafterConfig(kind=PLAIN)
    assert PLAIN not in registry.names() and not config.speculates and config.spec is None
    assert config.needs == Needs.NOTHING and not config.has_draft_cache and DrafterConfig().speculates
    target_config = TargetConfig(str(write_tiny_hf_model(tmp_path / "tiny")), dtype="float32", device="cpu")
    assert drafter_factory(config, target_config, target_config.load(), CacheConfig(), lambda line: None) is None


def test_every_drafter_flag_is_refused_off_its_default_for_a_drafter_that_does_not_read_it():
    """A flag is "given" when its field differs from DrafterConfig's default: at the default, any drafter takes it."""
    values = {"--draft-model": "d", "--draft-quant": "int8", "--draft-weights": "q8_0", "--head": "h.safetensors",
              "--draft-vocab": 8, "--ngram": (2, 4), "--tree-width": 2, "--skip-layers": "1",
              "--no-suffix-cache": False, "--suffix-cache-requests": 3, "--suffix-cache-mb": 8}
    assert set(values) == set(FLAG_FIELDS)
    defaults = DrafterConfig()
    with_models = registry.names_where(lambda spec: bool(spec.needs & Needs.DRAFT_MODEL))
    for flag, field in FLAG_FIELDS.items():
        readers = registry.names_where(lambda spec: flag in spec.flags)
        assert readers, flag
        for kind in [name for name in (PLAIN, *registry.names()) if name not in readers]:
            model = {"draft_model": "d"} if kind in with_models else {}
            DrafterConfig(kind=kind, **model, **{field: getattr(defaults, field)})  # the default is no choice
            with pytest.raises(ValueError, match=re.escape(f"{flag} is only used by --drafter {'|'.join(readers)}, "
                                                           f"not {kind}")):
                DrafterConfig(kind=kind, **model, **{field: values[flag]})


def test_the_defaults_are_the_drafters_own():
    config = DrafterConfig()
    assert config.ngram == (NgramDrafter.min_ngram, NgramDrafter.max_ngram)
    cache = SuffixCache()
    assert (config.suffix_cache_requests, config.suffix_cache_mb << 20, config.suffix_cache) == (
        cache.max_requests, cache.max_bytes, cache.enabled)


def test_skip_layers_belong_to_layerskip_and_are_resolved_when_it_is_loaded(tmp_path):
    with pytest.raises(ValueError, match=re.escape("--skip-layers is only used by --drafter layerskip, not ngram")):
        DrafterConfig(kind="ngram", skip_layers="1")
    target_config = TargetConfig(str(write_tiny_hf_model(tmp_path / "tiny")), dtype="float32", device="cpu")
    target = target_config.load()
    new = drafter_factory(DrafterConfig(kind="layerskip", skip_layers="1,2"), target_config, target, CacheConfig(),
                          lambda line: None)
    assert new().skip == (1, 2)  # each slot's drafter skips the layers the flag names
    with pytest.raises(ValueError, match="out of range"):
        drafter_factory(DrafterConfig(kind="layerskip", skip_layers="99"), target_config, target, CacheConfig(),
                        lambda line: None)


def test_the_suffix_cache_flags_belong_to_the_suffix_drafters_and_bound_one_shared_cache(tmp_path):
    with pytest.raises(ValueError, match=re.escape("--suffix-cache-mb is only used by --drafter "
                                                   "suffix|suffix-tree|auto, not ngram")):
        DrafterConfig(kind="ngram", suffix_cache_mb=8)
    with pytest.raises(ValueError, match=re.escape("--no-suffix-cache is only used by --drafter "
                                                   "suffix|suffix-tree|auto, not none")):
        DrafterConfig(kind=PLAIN, suffix_cache=False)
    target_config = TargetConfig(str(write_tiny_hf_model(tmp_path / "tiny")), dtype="float32", device="cpu")
    target = target_config.load()
    new = drafter_factory(DrafterConfig(kind="suffix", suffix_cache_requests=3, suffix_cache_mb=8),
                          target_config, target, CacheConfig(), lambda line: None)
    first, second = new(), new()
    assert first.cache is second.cache  # one cache per engine, shared by every slot's drafter
    assert (first.cache.max_requests, first.cache.max_bytes, first.cache.enabled) == (3, 8 << 20, True)
    off = drafter_factory(DrafterConfig(kind="suffix", suffix_cache=False), target_config, target, CacheConfig(),
                          lambda line: None)()
    assert off.cache.enabled is False and off.cache is not first.cache


def test_the_suffix_cache_is_made_for_the_drafters_whose_spec_needs_it(tmp_path, monkeypatch):
    """drafter_setup reads DrafterSpec.needs, not the drafter's name or flags: a drafter that needs the cache
    gets the one the flags bound, in DrafterInputs.shared, whatever it is called."""
    seen = []
    spec = DrafterSpec("cache-reader", lambda inputs: seen.append(inputs.shared) or NgramDrafter(), "reads the cache",
                       Needs.SUFFIX_CACHE)
    monkeypatch.setitem(registry._SPECS, spec.name, spec)
    target_config = TargetConfig(str(write_tiny_hf_model(tmp_path / "tiny")), dtype="float32", device="cpu")
    target = target_config.load()
    drafter_factory(DrafterConfig(kind=spec.name), target_config, target, CacheConfig(), lambda line: None)()
    (cache,) = seen[0].values()
    assert isinstance(cache, SuffixCache) and spec.learns
    monkeypatch.setitem(registry._SPECS, spec.name, DrafterSpec(spec.name, spec.build, spec.summary))
    drafter_factory(DrafterConfig(kind=spec.name), target_config, target, CacheConfig(), lambda line: None)()
    assert seen[1] == {}  # no need, no cache


def test_a_draft_model_defaults_to_the_cheapest_format_our_kernels_run(tmp_path):
    from kernel_paths import path_problem

    from specdecode.models.backends import TORCH
    from specdecode.models.build import draft_format

    assert draft_format("cheapest", TORCH) == "auto" and draft_format("q8_0", TORCH) == "q8_0"
    if path_problem("avx2") is not None:
        pytest.skip(f"needs one of our kernels: {path_problem('avx2')}")
    target_config = TargetConfig(str(write_tiny_hf_model(tmp_path / "t")), dtype="bfloat16", device="cpu", linear="avx2")
    target = target_config.load()
    said = []
    new = drafter_factory(DrafterConfig(kind="draft", draft_model=str(write_tiny_hf_model(tmp_path / "d", seed=1))),
                          target_config, target, CacheConfig(), said.append)
    assert new().model.weight_format == "q4_1" and any("(q4_1+head weights)" in line for line in said)  # head too
    explicit = drafter_factory(DrafterConfig(kind="draft", draft_model=str(tmp_path / "d"), draft_weights="auto"),
                               target_config, target, CacheConfig(), said.append)
    assert explicit().model.weight_format == "bf16"  # a folder's own format


def test_draft_model_auto_is_the_registered_targets_registered_draft(tmp_path):
    from specdecode.models import registry

    assert registry.draft_for("qwen2.5-coder-1.5b-instruct") == "qwen2.5-coder-0.5b-instruct"
    with pytest.raises(ValueError, match="names no registered draft; registered pairs: qwen2.5-coder-1.5b-instruct "
                                         "-> qwen2.5-coder-0.5b-instruct"):
        registry.draft_for("smollm2-135m-instruct")
    target_config = TargetConfig(str(write_tiny_hf_model(tmp_path / "t")), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="--draft-model auto: --model .* is not a registered model"):
        drafter_factory(DrafterConfig(kind="draft", draft_model="auto"), target_config, target_config.load(),
                        CacheConfig(), lambda line: None)


def test_tree_drafters_are_refused_on_a_model_with_mixed_windows(tmp_path):
    """Gemma 3's layers attend over different windows; a token tree's one key index cannot serve them."""
    target_config = TargetConfig(str(write_tiny_hf_model(tmp_path / "g", arch="gemma3")), dtype="float32",
                                 device="cpu")
    target = target_config.load()
    assert target.model.config.mixed_windows
    with pytest.raises(ValueError, match="ngram-tree drafts token trees"):
        drafter_factory(DrafterConfig(kind="ngram-tree"), target_config, target, CacheConfig(), lambda line: None)
    assert drafter_factory(DrafterConfig(kind="ngram"), target_config, target, CacheConfig(),
                           lambda line: None)() is not None  # the chain form is fine


def test_a_draft_models_draft_vocabulary_holds_the_first_ids_and_the_targets_end_ids_once_for_every_slot(tmp_path):
    target_config = TargetConfig(str(write_tiny_hf_model(tmp_path / "t")), dtype="float32", device="cpu")
    target = target_config.load()
    draft = str(write_tiny_hf_model(tmp_path / "d", seed=1))
    new = drafter_factory(DrafterConfig(kind="draft", draft_model=draft, draft_vocab=10), target_config, target,
                          CacheConfig(), lambda line: None)
    first, second = new(), new()
    assert first.vocab is second.vocab  # one draft vocabulary's head, shared
    eos = sorted(target.tokenizer.eos_token_ids)
    rest = [i for i in range(target.model.config.vocab_size) if i not in eos][:10 - len(eos)]
    assert eos and first.vocab.ids.tolist() == sorted(eos + rest)
    for whole in (None, 0):  # the default: all
        assert drafter_factory(DrafterConfig(kind="draft", draft_model=draft, draft_vocab=whole), target_config,
                               target, CacheConfig(), lambda line: None)().vocab is None
    only = "--draft-vocab is only used by --drafter draft|draft-tree|auto|eagle"
    with pytest.raises(ValueError, match=re.escape(only)):
        DrafterConfig(kind="ngram", draft_vocab=10)
