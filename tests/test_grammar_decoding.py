"""Decoding under a grammar is exact: greedy output is the same with speculation as without, in any batch, and
sampled output follows the target's distribution masked by the grammar (``distribution_check.py``'s test on the
joint of the first three tokens, here masked), with forced tokens drafted and drafts the grammar refuses."""

from __future__ import annotations

import re

import pytest
import torch

from distribution_check import (ALPHA, LETTERS, NEW_TOKENS, PROMPT, SAMPLES, VOCAB, chi_square_p_value, exact_joint,
                                letter_ids, sample_counts, small_vocab_model, small_vocab_target,
                                small_vocab_tokenizer)
from specdecode.batch import grammar_rows as grammar_rows_module
from specdecode.batch.executor import BatchEngine
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.drafters import DraftModelDrafter, NgramDrafter, NgramTreeDrafter
from specdecode.drafters import forced as forced_module
from specdecode.drafters.auto import AutoDrafter
from specdecode.drafters.base import Draft
from specdecode.drafters.prediction import PredictionDrafter
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.grammar import Grammar
from specdecode.models.build import from_hf_tensors, pack_model
from specdecode.sampling import SamplingParams
from kernel_paths import NATIVE_PATHS, path_params, require_path
from tiny_models import random_hf_tensors, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

# Free, forced, free: the first three tokens' allowed sets do not depend on what came before.
PATTERN = "[a-g]b[c-j][a-o]{2,}"
ALLOWED = ("abcdefg", "b", "cdefghij")


@pytest.fixture(scope="module")
def target():
    return small_vocab_target()


@pytest.fixture(scope="module")
def tokenizer():
    return small_vocab_tokenizer()


def _drafter(kind: str):
    if kind == "ngram":
        return NgramDrafter(min_ngram=1, max_ngram=2)
    if kind == "ngram-tree":
        return NgramTreeDrafter(min_ngram=1, max_ngram=2)
    if kind == "auto":  # past the forced tokens its prompt lookup drafts (the suffix tries hold verified tokens)
        return AutoDrafter(min_ngram=1, max_ngram=2)
    return DraftModelDrafter(small_vocab_model(11, layers=1), tree_width=3 if kind == "draft-tree" else 0)


def _allowed(letters: str) -> torch.Tensor:
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[[LETTERS.index(c) for c in letters]] = True
    return mask


@pytest.mark.parametrize("kind, sampling", [
    pytest.param("draft", SamplingParams(temperature=1.0), id="draft-T1"),
    pytest.param("ngram", SamplingParams(temperature=1.0), id="ngram-T1"),
    pytest.param("auto", SamplingParams(temperature=1.0), id="auto-T1"),
    pytest.param("draft-tree", SamplingParams(temperature=1.0), id="draft-tree-T1", marks=pytest.mark.slow),
    pytest.param("ngram-tree", SamplingParams(temperature=0.5, top_k=6), id="ngram-tree-T0.5-k6",
                 marks=pytest.mark.slow),
    pytest.param("draft", SamplingParams(temperature=1.0, top_k=8, top_p=0.9), id="draft-k8-p0.9",
                 marks=pytest.mark.slow),
])
def test_constrained_sampling_matches_the_masked_target_distribution(target, tokenizer, kind, sampling):
    engine = Engine(target, tokenizer, _drafter(kind), SpeculativeConfig(gamma=3))
    drafted = []
    counts = sample_counts(engine, sampling, grammar=Grammar.regex(PATTERN),
                           on_result=lambda r: drafted.append((r.stats.forced_drafted, r.stats.drafted_tokens)))
    p_value = chi_square_p_value(counts, exact_joint(target, sampling, tuple(_allowed(a) for a in ALLOWED)))
    assert p_value > ALPHA, f"{kind} at {sampling}: chi-square p = {p_value:.2e}"
    forced, total = map(sum, zip(*drafted))
    assert forced > SAMPLES // 10 and total > forced  # the forced "b" was drafted, and the drafter's tokens too


def test_constrained_sampling_with_a_prediction_matches_the_masked_target_distribution(target, tokenizer):
    """A prediction drafted around the forced "b" (before it and, one-hot, after it) keeps the masked distribution."""
    engine = Engine(target, tokenizer, None, SpeculativeConfig(gamma=3))
    sampling, drafted = SamplingParams(temperature=1.0), []
    counts = sample_counts(engine, sampling, grammar=Grammar.regex(PATTERN), prediction=letter_ids("cbdd"),
                           on_result=lambda r: drafted.append(r.stats.prediction_drafted))
    p_value = chi_square_p_value(counts, exact_joint(target, sampling, tuple(_allowed(a) for a in ALLOWED)))
    assert p_value > ALPHA, f"prediction at {sampling}: chi-square p = {p_value:.2e}"
    assert sum(drafted) > SAMPLES


def _cut_before_refused(draft: Draft, constraint) -> Draft:
    """The wrong cut for a sampled draft: before its first refused token, as for a one-hot one."""
    n = constraint.valid(draft.tokens)
    return Draft(draft.tokens[:n], None if draft.q is None else draft.q[:n], [], None, min(draft.forced, n))


@pytest.mark.slow
def test_negative_control_cutting_a_sampled_draft_before_its_refused_token_is_detected(target, tokenizer,
                                                                                       monkeypatch):
    """Why ``within`` keeps a sampled draft's refused token: cut before it, the next token is drawn from p where the
    rejection's residual max(0, p - q) was due, and the distribution test sees it (a small bias here: it takes three
    times the samples; at SAMPLES, p was 0.016)."""
    monkeypatch.setattr("specdecode.batch.proposing.within", _cut_before_refused)
    assert forced_module.within is not _cut_before_refused
    engine = Engine(target, tokenizer, _drafter("draft"), SpeculativeConfig(gamma=3))
    sampling = SamplingParams(temperature=1.0)
    counts = sample_counts(engine, sampling, 3 * SAMPLES, grammar=Grammar.regex(PATTERN))
    p_value = chi_square_p_value(counts, exact_joint(target, sampling, tuple(_allowed(a) for a in ALLOWED)))
    assert p_value < ALPHA, f"the wrong cut passed: p = {p_value:.2e}"


GREEDY_PATTERNS = ["[a-g]b[c-j]([a-e]c)+", "(abc|abd|bcd)+", "[a-o]{3}b[a-o]{2}b[a-o]*"]


def _check_greedy_identity(target, tokenizer, kind: str) -> None:
    """Constrained greedy output with ``kind`` drafting, alone and batched beside an unconstrained request, equals
    constrained plain decoding's; complete answers match their grammar; forced tokens were drafted and kept."""
    plain = Engine(target, tokenizer)
    spec = Engine(target, tokenizer, _drafter(kind), SpeculativeConfig(gamma=4))
    batch = BatchEngine(target, tokenizer, lambda: _drafter(kind), SpeculativeConfig(gamma=4),
                        scheduler=SchedulerConfig(max_running=3), max_len=96)
    requests = [dict(prompt=PROMPT[:n], max_new_tokens=24, eos_token_ids=(), grammar=Grammar.regex(pattern))
                for n in (3, 8) for pattern in GREEDY_PATTERNS]
    patterns = {id(r["grammar"]): p for r, p in zip(requests, GREEDY_PATTERNS * 2)}
    requests.append(dict(prompt=PROMPT, max_new_tokens=24, eos_token_ids=()))  # one without a grammar beside them
    together = batch.run(requests)
    forced = 0
    for request, served in zip(requests, together):
        alone = plain.generate(**request)
        fast = spec.generate(**request)
        assert fast.token_ids == alone.token_ids == served.token_ids, request
        assert fast.finish_reason == alone.finish_reason == served.finish_reason
        forced += fast.stats.forced_accepted
        if "grammar" in request and alone.finish_reason == "stop":  # complete: the text matches the grammar
            assert re.fullmatch(patterns[id(request["grammar"])], alone.text), alone.text
    assert forced > 0


@pytest.mark.parametrize("kind", ["ngram", "ngram-tree", "draft", "draft-tree", "auto"])
def test_constrained_greedy_output_is_plain_constrained_greedy_output_in_any_batch(target, tokenizer, kind):
    _check_greedy_identity(target, tokenizer, kind)


PREDICTED_PATTERNS = ["[a-g]b[c-j]([a-e]c)+", "([a-o]{2}bc)+", "[a-o]{3}bcd[a-o]{3}bcd[a-o]*"]  # 24-token answers


@pytest.mark.parametrize("kind", [None, "ngram"])
def test_a_prediction_drafts_past_forced_tokens_and_greedy_output_stays_plain_decodings(target, tokenizer, kind,
                                                                                         monkeypatch):
    """With a grammar and a prediction (plain decoding's own answer, one token edited), the prediction drafts after
    the forced tokens too; tokens are constrained plain decoding's, alone and batched."""
    past_forced = []  # the prediction's proposals made after tokens not yet verified
    propose = PredictionDrafter.propose

    def counting(self, seq, *args, **kwargs):
        draft = propose(self, seq, *args, **kwargs)
        past_forced.append(len(seq) > self._seen and bool(draft.tokens) and self._proposed == draft.tokens)
        return draft
    monkeypatch.setattr(PredictionDrafter, "propose", counting)
    plain = Engine(target, tokenizer)
    spec = Engine(target, tokenizer, _drafter(kind) if kind else None, SpeculativeConfig(gamma=4))
    batch = BatchEngine(target, tokenizer, (lambda: _drafter(kind)) if kind else None, SpeculativeConfig(gamma=4),
                        scheduler=SchedulerConfig(max_running=3), max_len=96)
    requests = []
    for pattern in PREDICTED_PATTERNS:
        request = dict(prompt=PROMPT, max_new_tokens=24, eos_token_ids=(), grammar=Grammar.regex(pattern))
        answer = plain.generate(**request).token_ids
        edited = answer[:5] + [answer[5] ^ 1] + answer[6:]  # an edit: the place is found again after it
        requests.append({**request, "prediction": edited})
        fast = spec.generate(**requests[-1])
        assert fast.token_ids == answer and fast.stats.forced_accepted > 0
    assert [r.token_ids for r in batch.run(requests)] == [plain.generate(**r).token_ids for r in requests]
    assert sum(past_forced) >= len(PREDICTED_PATTERNS)


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
def test_constrained_greedy_identity_on_each_of_our_kernel_paths(tokenizer, path):
    """The same on a bf16 target packed for each of our kernels (forced, skipped with the reason where this CPU
    cannot run it): masks go on the logits whatever computed them."""
    require_path(path)
    config = tiny_config("llama", vocab_size=VOCAB)
    target = from_hf_tensors(config, random_hf_tensors(config, 7, scale=0.2), dtype=torch.bfloat16)
    pack_model(target, path)
    for kind in ("ngram", "draft"):
        _check_greedy_identity(target, tokenizer, kind)


def test_constrained_sampled_tokens_depend_only_on_the_seed_in_any_batch(target, tokenizer):
    """With n-gram drafting (one-hot) or none, a seeded constrained request draws the same tokens alone, batched
    among others (constrained or not), and without speculation."""
    sampling = [SamplingParams(temperature=1.0, seed=s) for s in range(6)]
    requests = [dict(prompt=PROMPT, sampling=p, max_new_tokens=16, eos_token_ids=(),
                     grammar=Grammar.regex(GREEDY_PATTERNS[p.seed % 3]) if p.seed % 2 == 0 else None)
                for p in sampling]
    batch = BatchEngine(target, tokenizer, lambda: _drafter("ngram"), SpeculativeConfig(gamma=4),
                        scheduler=SchedulerConfig(max_running=4), max_len=96)
    together = batch.run(requests)
    plain, spec = Engine(target, tokenizer), Engine(target, tokenizer, _drafter("ngram"), SpeculativeConfig(gamma=4))
    for request, served in zip(requests, together):
        assert plain.generate(**request).token_ids == spec.generate(**request).token_ids == served.token_ids


class _EndsEarly(NgramDrafter):
    """Proposes the letters of "ab" then end-of-sequence tokens, whatever the sequence: drafts that run past a
    grammar's completion (a draft model often proposes the end after a closing brace)."""

    def propose(self, seq, k, sampling, generator, stop=None):
        return Draft(([LETTERS.index("a"), LETTERS.index("b")] + [VOCAB - 1] * k)[:k])


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)])
def test_drafts_past_the_grammars_completion_end_where_plain_decoding_ends(target, tokenizer, sampling):
    grammar = Grammar.choice(["ab", "cd"])
    plain = Engine(target, tokenizer).generate(PROMPT, sampling, 8, eos_token_ids=(), grammar=grammar)
    spec = Engine(target, tokenizer, _EndsEarly(), SpeculativeConfig(gamma=4)).generate(
        PROMPT, sampling, 8, eos_token_ids=(), grammar=grammar)
    assert spec.token_ids == plain.token_ids and spec.text in ("ab", "cd")
    assert spec.finish_reason == plain.finish_reason == "stop"
    # Complete on the budget's last token: a whole answer ("stop"), not a cut one ("length").
    assert Engine(target, tokenizer).generate(PROMPT, sampling, 2, eos_token_ids=(), grammar=grammar).finish_reason \
        == "stop"


@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_steps_the_grammar_decides_get_no_head_and_change_nothing(target, tokenizer, kind, monkeypatch):
    """A step whose grammars leave every row one token skips the output head (those rows' logits: 0 for the token,
    -inf elsewhere): tokens and finish reasons, greedy and seeded sampling, batched, are those of computing the head
    at every row; log-probabilities too (to float rounding: torch's head is not row-invariant, so it rounds a row by
    the rows beside it). Plain decoding skips the head at the forced letters' steps; drafted steps rarely qualify
    (the row after a draft is seldom forced too)."""
    skipping, computing = _decided_against_computed(target, tokenizer, kind, monkeypatch, fewer=kind == "none")
    assert [(tokens, finish) for tokens, finish, _ in skipping] == [(tokens, finish) for tokens, finish, _ in computing]
    for (_, _, fast), (_, _, full) in zip(skipping, computing):
        assert [(lp.token, [t for t, _ in lp.top]) for lp in fast] == [(lp.token, [t for t, _ in lp.top]) for lp in full]
        assert [lp.logprob for lp in fast] == pytest.approx([lp.logprob for lp in full], abs=1e-5)


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
def test_steps_the_grammar_decides_change_no_bit_on_our_kernels(tokenizer, path, monkeypatch):
    """The same on a target packed for each of our kernels, whose rows are computed alike in any forward: every
    token and log-probability bitwise."""
    require_path(path)
    config = tiny_config("llama", vocab_size=VOCAB)
    target = from_hf_tensors(config, random_hf_tensors(config, 7, scale=0.2), dtype=torch.bfloat16)
    pack_model(target, path)
    for kind in ("none", "ngram"):
        skipping, computing = _decided_against_computed(target, tokenizer, kind, monkeypatch, fewer=kind == "none")
        assert skipping == computing


def _decided_against_computed(target, tokenizer, kind: str, monkeypatch, fewer: bool) -> tuple[list, list]:
    """Constrained requests (greedy and seeded, logprobs 2) run twice by a batch engine: steps the grammars decide
    without the head (as served; ``fewer``: some were), then the head at every step; (tokens, finish, logprobs) per
    request, each run."""
    requests = [dict(prompt=PROMPT[:n], max_new_tokens=24, eos_token_ids=(), grammar=Grammar.regex(pattern),
                     logprobs=2, sampling=sampling)
                for n in (3, 8) for pattern in GREEDY_PATTERNS
                for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=n))]
    forward_rows, head_rows = target.forward_rows, []

    def counting(*args, logits, **kwargs):
        head_rows.append(len(logits.index) if logits.wanted else 0)
        return forward_rows(*args, logits=logits, **kwargs)

    def run() -> tuple[list, int]:
        head_rows.clear()
        engine = BatchEngine(target, tokenizer, (lambda: _drafter(kind)) if kind != "none" else None,
                             SpeculativeConfig(gamma=4), scheduler=SchedulerConfig(max_running=3), max_len=96)
        logprobs = [[] for _ in requests]
        results = engine.run([dict(r, on_output=lambda seq, out, i=i: logprobs[i].extend(out.logprobs or []))
                              for i, r in enumerate(requests)])
        assert all(len(lp) == len(r.token_ids) for lp, r in zip(logprobs, results))
        return [(r.token_ids, r.finish_reason, lp) for r, lp in zip(results, logprobs)], sum(head_rows)
    with monkeypatch.context() as patch:
        patch.setattr(target, "forward_rows", counting)
        skipping, skipped_rows = run()
        patch.setattr(grammar_rows_module, "sole_tokens", lambda masks: {})  # every row through the head
        computing, computed_rows = run()
    assert skipped_rows < computed_rows if fewer else skipped_rows <= computed_rows
    return skipping, computing
