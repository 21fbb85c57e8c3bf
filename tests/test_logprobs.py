"""logprobs.py and the engine's log-probabilities: each emitted token's is the target's log-softmax at the row
that predicted it, with its top alternatives, and a request's are the same bitwise with and without speculation
and whatever it is batched with (on our kernels, whose rows do not depend on their neighbours)."""

from __future__ import annotations

import pytest
import torch

from batch_cases import requests
from kernel_paths import NATIVE_PATHS, path_params, require_path
from specdecode.batch.executor import BatchEngine
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.drafters import DraftModelDrafter, NgramDrafter
from specdecode.engine import SpeculativeConfig
from specdecode.kv.cache import CacheConfig
from specdecode.logprobs import token_logprobs, verdict_rows
from specdecode.models.build import pack_model
from specdecode.sampling import SamplingParams
from tiny_models import random_head_drafter, varied_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_token_logprobs_are_the_log_softmax_at_each_row_with_the_top_alternatives():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 50, generator=g)
    got = token_logprobs(rows, [4, 0, 49], top=5)
    want = torch.log_softmax(rows.double(), -1)
    for i, (lp, token) in enumerate(zip(got, [4, 0, 49])):
        assert lp.token == token and lp.logprob == pytest.approx(want[i, token].item(), abs=1e-5)
        ids = [t for t, _ in lp.top]
        assert ids == want[i].topk(5).indices.tolist() and [v for _, v in lp.top] == sorted([v for _, v in lp.top],
                                                                                            reverse=True)
    assert all(lp.top == () for lp in token_logprobs(rows, [1, 2, 3], top=0))


def test_the_rows_that_predicted_a_steps_tokens():
    assert verdict_rows(2, None) == [0, 1, 2]  # a chain: the fed token's row, then the kept drafts'
    assert verdict_rows(2, [0, 3]) == [0, 1, 4]  # a tree: the kept nodes' rows


def _logprobs(engine: BatchEngine, top: int, sampling: SamplingParams = SamplingParams()) -> list[list[tuple]]:
    """Every request's (token, logprob, top) per emitted token, the requests served together."""
    got: dict[int, list[tuple]] = {}
    seqs = []
    for r in requests():
        def keep(seq, out, got=got):
            got.setdefault(seq.id, []).extend((lp.token, lp.logprob, lp.top) for lp in out.logprobs)
        seqs.append(engine.submit(r["prompt"], sampling, r["max_new_tokens"], eos_token_ids=(), on_output=keep,
                                  logprobs=top))
    while engine.has_work:
        engine.step()
    return [got.get(s.id, []) for s in seqs]


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
def test_logprobs_are_the_same_with_and_without_speculation_batched_or_alone(path):
    require_path(path)
    model = varied_model(0, dtype=torch.bfloat16)
    pack_model(model, path)
    draft = varied_model(0, dtype=torch.bfloat16, keep_layers=[0, 1])
    pack_model(draft, path)
    plain = _logprobs(BatchEngine(model, max_len=96, scheduler=SchedulerConfig(max_running=1)), top=3)  # alone
    for new in (NgramDrafter, lambda: DraftModelDrafter(draft, model, CacheConfig()),
                lambda: DraftModelDrafter(draft, model, CacheConfig(), tree_width=2),  # trees: rows 1 + node
                lambda: random_head_drafter("medusa", model, seed=3),  # heads read the target's features
                lambda: random_head_drafter("eagle-tree", model, seed=3, cache=CacheConfig())):
        engine = BatchEngine(model, new_drafter=new, spec=SpeculativeConfig(gamma=4), max_len=96,
                             scheduler=SchedulerConfig(max_running=4))
        assert _logprobs(engine, top=3) == plain  # bitwise: tokens, log-probabilities and alternatives
    for p, r in zip(plain, requests()):
        assert len(p) == r["max_new_tokens"] and all(len(top) == 3 and top[0][1] >= lp for _, lp, top in p)


def test_a_sampled_requests_logprobs_are_of_the_models_distribution():
    """Temperature shapes the draw, not the reported distribution: log-probabilities before temperature."""
    model = varied_model(0)
    cold = _logprobs(BatchEngine(model, max_len=96), top=1, sampling=SamplingParams(temperature=0.5, seed=3))
    ids = torch.tensor(requests()[2]["prompt"] + [t for t, _, _ in cold[2]])
    with torch.inference_mode():
        logits = model(ids[None], model.new_cache(CacheConfig(max_len=len(ids)))).logits[0]  # [T, V]
    want = torch.log_softmax(logits.double(), -1)
    start = len(requests()[2]["prompt"]) - 1
    for i, (token, lp, _) in enumerate(cold[2]):
        assert lp == pytest.approx(want[start + i, token].item(), abs=1e-4)


def test_logprobs_out_of_range_are_refused():
    engine = BatchEngine(varied_model(0), max_len=96)
    with pytest.raises(ValueError, match="logprobs must be in 0..20"):
        engine.submit([1, 2], logprobs=21)
