"""Every backend against what the protocol (``backends/base.py``) promises, on each that can run here (the others
skip with the reason): our kernels fused and unfused, oneDNN, torch (also on a GPU where torch sees one).

- Its greedy tokens are the float32 reference's: teacher-forced, the argmax agrees at >= 80% of positions (the
  tolerance the other tests of one model under other rounding use), and the logits stay within bf16 noise: no
  further from the float32 logits than 1.5x the distance of torch's own bf16 model (the same weights, unpacked).
- Greedy speculation on it reproduces plain greedy decoding on it token for token (the engine's claim).
- A row-invariant backend computes each row bitwise the same whatever else shares the forward.
- ``synchronize`` returns once the device is idle (a no-op on the CPU).
"""

from __future__ import annotations

import pytest
import torch

from specdecode.drafters import NgramDrafter
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import pack_model
from specdecode.models.rows import LogitRows
from kernel_paths import NATIVE_PATHS, path_params
from tiny_models import varied_model

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9], [90, 3, 17, 44, 2, 60], [50, 51, 50, 51, 52, 50, 51, 50, 51, 52]]
NEW_TOKENS = 24
AGREEMENT = 0.8
BF16_NOISE_FACTOR = 1.5  # other rounding orders than torch's, same bf16 weights and activations
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False")
CASES = [*[pytest.param(p.values[0], True, "cpu", id=p.id, marks=p.marks) for p in path_params()],
         *[pytest.param(p.values[0], False, "cpu", id=f"{p.id}-unfused", marks=p.marks)
           for p in path_params(NATIVE_PATHS)],
         pytest.param("torch", True, "cuda", id="torch-cuda", marks=[NO_CUDA, pytest.mark.device])]


def _on(path: str, fuse: bool, device: str):
    model = varied_model(0, dtype=torch.bfloat16).to(device)
    backend = pack_model(model, path, fuse=fuse)
    assert backend.name == path and model.backend is backend
    return model


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """The float32 model's greedy continuations of PROMPTS (torch, unpacked)."""
    model = varied_model(0)
    return [Engine(model).generate(p, max_new_tokens=NEW_TOKENS, eos_token_ids=()).token_ids for p in PROMPTS]


def _teacher_forced_logits(model, prompt: list[int], want: list[int], device: str = "cpu") -> torch.Tensor:
    """[len(want), vocab] float32 logits at the positions that predict ``want``."""
    ids = torch.tensor([prompt + want[:-1]], device=device)
    with torch.inference_mode():
        return model(ids, model.new_cache(CacheConfig(max_len=64))).logits[0, len(prompt) - 1:].float().cpu()


@pytest.mark.parametrize("path,fuse,device", CASES)
def test_greedy_tokens_are_the_references(path, fuse, device, reference):
    model, ref, torch_bf16 = _on(path, fuse, device), varied_model(0), varied_model(0, dtype=torch.bfloat16)
    hits = total = 0
    for prompt, want in zip(PROMPTS, reference):
        got = _teacher_forced_logits(model, prompt, want, device)
        exact = _teacher_forced_logits(ref, prompt, want)
        noise = (_teacher_forced_logits(torch_bf16, prompt, want) - exact).abs().max()
        assert (got - exact).abs().max() <= BF16_NOISE_FACTOR * noise, (path, fuse, prompt)
        hits += int((got.argmax(-1) == torch.tensor(want)).sum())
        total += len(want)
    assert hits / total >= AGREEMENT, (path, fuse, hits, total)


@pytest.mark.parametrize("path,fuse,device", CASES)
def test_greedy_speculation_reproduces_plain_decoding_on_it(path, fuse, device):
    model = _on(path, fuse, device)
    plain = [Engine(model).generate(p, max_new_tokens=NEW_TOKENS, eos_token_ids=()).token_ids for p in PROMPTS]
    engine = Engine(model, drafter=NgramDrafter(max_ngram=3, min_ngram=1), spec=SpeculativeConfig(gamma=4))
    drafted = 0
    for prompt, want in zip(PROMPTS, plain):
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_ids=())
        assert result.token_ids == want, (path, fuse, prompt)
        drafted += result.stats.drafted_tokens
    assert drafted > 0  # verification forwards of several rows really ran


@pytest.mark.parametrize("path,fuse,device", CASES)
def test_a_row_invariant_backend_computes_each_row_as_alone(path, fuse, device):
    model = _on(path, fuse, device)
    if not model.backend.row_invariant:
        pytest.skip(f"{path} does not claim row invariance (the engine gives its forwards at least two rows)")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (n,), generator=g) for n in (13, 6)]
    rows = [torch.randint(0, 97, (n,), generator=g) for n in (9, 3)]
    with torch.inference_mode():
        together, alone = (model.new_cache(CacheConfig(max_len=32, slots=2)) for _ in range(2))
        for slot, prompt in enumerate(prompts):
            for cache in (together, alone):
                model.forward_rows(prompt, cache, (slot,), (len(prompt),), logits=LogitRows.NONE)
        out = model.forward_rows(torch.cat(rows), together, (0, 1), (9, 3), features=(2,))
        single = [model.forward_rows(rows[0][i:i + 1], alone, (0,), (1,), features=(2,)) for i in range(9)]
        single.append(model.forward_rows(rows[1], alone, (1,), (3,), features=(2,)))
    assert torch.equal(out.logits, torch.cat([s.logits for s in single]))
    assert torch.equal(out.features, torch.cat([s.features for s in single]))
    assert together.lengths == alone.lengths == [22, 9]
    assert all(torch.equal(a, b) for a, b in zip(together.k + together.v, alone.k + alone.v))


@pytest.mark.parametrize("path,fuse,device", CASES)
def test_synchronize_waits_for_the_device(path, fuse, device):
    model = _on(path, fuse, device)
    with torch.inference_mode():
        out = model(torch.tensor([PROMPTS[0]], device=device), model.new_cache(CacheConfig(max_len=16)))
    model.synchronize()  # after it, reading the result waits on nothing
    if device == "cuda":
        assert torch.cuda.current_stream(model.device).query()
    assert out.logits.shape == (1, len(PROMPTS[0]), 97)
