"""A token tree scored in one forward (``forward_rows`` with parents) against decoding each of its paths."""

from __future__ import annotations

import pytest
import torch

from specdecode.kv.cache import CacheConfig
from specdecode.models.build import from_hf_tensors, pack_model
from specdecode.models.rows import LogitRows
from specdecode.models.transformer import Transformer
from specdecode.tree import children, path_to
from tests.kernel_paths import NATIVE_PATHS, path_params, require_path
from tests.tiny_models import random_hf_tensors, tiny_config

# Rows [root, nodes...]: row-level parents of a tree two wide at the first two depths, one branch three deep.
TREE = [-1, 0, 0, 1, 1, 2, 4, 0]
CACHES = [dict(), dict(kv_dtype="int8", group_size=4, residual=4), dict(kv_dtype="int4", group_size=4, residual=4),
          dict(window=12, sinks=2, evict_chunk=4)]


def _model(path: str, **overrides) -> Transformer:
    config = tiny_config("mistral" if overrides else "llama", tie_word_embeddings=False, **overrides)
    model = from_hf_tensors(config, random_hf_tensors(config, seed=4, scale=0.2), dtype=torch.bfloat16)
    pack_model(model, path)
    return model


def _decode(model, cache, tokens: list[int]) -> torch.Tensor:
    """Logits ``[len(tokens), V]`` of feeding ``tokens`` one forward each (what plain decoding computes)."""
    return torch.cat([model.forward_rows(torch.tensor([t]), cache, (0,), (1,)).logits for t in tokens])


def _leaves(parents: list[int]) -> list[int]:
    kids = children(parents)
    return [j for j in range(len(parents)) if j not in kids]


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
@pytest.mark.parametrize("window", [None, 6], ids=["full", "sliding-window"])
def test_each_tree_row_equals_decoding_its_path(path, window):
    """Every row of a tree forward gives, bitwise, the logits decoding its root-to-row path gives, on our
    kernels (row-invariant by construction; F.linear's one-row and multi-row products differ on some CPUs)."""
    require_path(path)
    model = _model(path, **({} if window is None else {"sliding_window": window}))
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, model.config.vocab_size, (21,), generator=g)
    tokens = torch.randint(0, model.config.vocab_size, (len(TREE),), generator=g)
    with torch.inference_mode():
        cache = model.new_cache(CacheConfig(max_len=40))
        model.forward_rows(prompt, cache, (0,), (21,), logits=LogitRows.NONE)
        tree_logits = model.forward_rows(tokens, cache, (0,), (len(TREE),), parents=[TREE]).logits
        assert cache.lengths[0] == 21 + len(TREE)
        for leaf in _leaves(TREE):
            rows = path_to(TREE, leaf)
            cache.trim(0, 21)
            decoded = _decode(model, cache, tokens[rows].tolist())
            assert torch.equal(tree_logits[rows], decoded), (path, window, rows)


@pytest.mark.parametrize("path", path_params(("tiled", "avx512", "avx2", "torch")))
@pytest.mark.parametrize("setting", CACHES, ids=["plain", "int8", "int4", "window"])
def test_an_accepted_path_compacted_leaves_the_cache_plain_decoding_builds(path, setting):
    """After a tree forward and ``compact`` to one path, the next forwards give, bitwise, what they give after
    decoding that path; the plain cache's buffers equal the decoded ones too."""
    require_path(path)
    model = _model(path)
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, model.config.vocab_size, (19,), generator=g).tolist()
    tokens = torch.randint(0, model.config.vocab_size, (len(TREE),), generator=g)
    after = torch.randint(0, model.config.vocab_size, (6,), generator=g).tolist()
    rows = path_to(TREE, 6)  # rows 0, 1, 4, 6: not a prefix of the rows
    config = CacheConfig(max_len=48, lookahead=16, prefill_chunk=8, **setting)
    with torch.inference_mode():
        caches, logits = [], []
        for use_tree in (True, False):
            cache = model.new_cache(config)
            for start in range(0, len(prompt), 8):
                chunk = prompt[start:start + 8]
                model.forward_rows(torch.tensor(chunk), cache, (0,), (len(chunk),), logits=LogitRows.NONE)
                cache.commit(0, cache.lengths[0])
            if use_tree:
                model.forward_rows(tokens, cache, (0,), (len(TREE),), parents=[TREE])
                cache.compact(0, len(prompt), rows)
            else:
                _decode(model, cache, tokens[rows].tolist())
            assert cache.lengths[0] == len(prompt) + len(rows)
            cache.commit(0, cache.lengths[0])
            logits.append(_decode(model, cache, after))
            caches.append(cache)
    assert torch.equal(logits[0], logits[1]), (path, setting)
    if not setting:
        end = len(prompt) + len(rows) + len(after)
        for layer in range(model.config.num_layers):
            assert torch.equal(caches[0].k[layer][:, :, :end], caches[1].k[layer][:, :, :end])
            assert torch.equal(caches[0].v[layer][:, :, :end], caches[1].v[layer][:, :, :end])


@pytest.mark.parametrize("path", path_params(("tiled", "avx512", "torch")))
def test_a_tree_grown_a_level_per_forward_equals_the_tree_in_one_forward(path):
    """A drafter grows its tree one level per forward (``parents`` then covers the earlier rows too): the rows'
    logits and the cache equal one forward over the whole tree."""
    require_path(path)
    model = _model(path)
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, model.config.vocab_size, (15,), generator=g)
    tokens = torch.randint(0, model.config.vocab_size, (len(TREE),), generator=g)
    levels = [1, 3, 7, 8]  # rows by depth: [0], [1, 2], [3, 4, 5, 6], [7]... as TREE's depths allow
    with torch.inference_mode():
        whole, grown = (model.new_cache(CacheConfig(max_len=40)) for _ in range(2))
        for cache in (whole, grown):
            model.forward_rows(prompt, cache, (0,), (15,), logits=LogitRows.NONE)
        one = model.forward_rows(tokens, whole, (0,), (len(TREE),), parents=[TREE]).logits
        parts, done = [], 0
        for end in levels:
            parts.append(model.forward_rows(tokens[done:end], grown, (0,), (end - done,),
                                            parents=[TREE[:end]]).logits)
            done = end
    assert torch.equal(one, torch.cat(parts)), path
    for layer in range(model.config.num_layers):
        assert torch.equal(whole.k[layer][:, :, :15 + len(TREE)], grown.k[layer][:, :, :15 + len(TREE)])


def test_a_tree_shares_a_forward_with_other_sequences_row_invariantly():
    """A tree in one slot and a chain in another, in one forward, give what each gives alone."""
    model = _model("torch")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (9, 14)]
    rows = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (len(TREE), 3)]
    with torch.inference_mode():
        together, alone = (model.new_cache(CacheConfig(max_len=32, slots=2)) for _ in range(2))
        for slot, prompt in enumerate(prompts):
            for cache in (together, alone):
                model.forward_rows(prompt, cache, (slot,), (len(prompt),), logits=LogitRows.NONE)
        both = model.forward_rows(torch.cat(rows), together, (0, 1), (len(TREE), 3), parents=[TREE, None]).logits
        first = model.forward_rows(rows[0], alone, (0,), (len(TREE),), parents=[TREE]).logits
        second = model.forward_rows(rows[1], alone, (1,), (3,)).logits
    assert torch.equal(both, torch.cat([first, second]))


@pytest.mark.parametrize("parents, message", [
    ([[-1, 1, 0]], "parent must be an earlier node"),
    ([[-1, 0]], "a tree of 2 rows cannot end in 3 new rows"),
    ([None, None], "one parents entry per slot"),
])
def test_bad_tree_input_is_refused_before_anything_is_written(parents, message):
    model = _model("torch")
    with torch.inference_mode():
        cache = model.new_cache(CacheConfig(max_len=16))
        with pytest.raises(ValueError, match=message):
            model.forward_rows(torch.zeros(3, dtype=torch.long), cache, (0,), (3,), parents=parents)
    assert cache.lengths == [0]
