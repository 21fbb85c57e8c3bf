"""Speculative sampling reproduces the target's distribution exactly, across sampling settings (every
registered drafter at T=1 is in tests/drafters/test_conformance.py).

Method (``distribution_check.py``): a tiny random target with a 16-token vocabulary; the exact joint
distribution of the first three generated tokens is computed from the target alone (16 * 16 * 16 = 4096
outcomes). The engine then generates three tokens N times with different seeds, with gamma large enough
that several draft positions are verified in one step, and a chi-square goodness-of-fit test compares
counts with the exact joint (outcomes with small expected counts are pooled so every bin expects >= 5).

False-failure rate: each case uses significance level ALPHA = 1e-3, so a correct engine fails a given
case with probability 0.1% for a random set of seeds; over the dozen default cases about 1%. Seeds are fixed,
so a run is reproducible. The test's power is shown by the negative control: the seed document's lossy
rule ("accept if p >= q, else resample from p / (1 - q)") is rejected by the same test. The trained-head
drafters (random heads here) draft over a 4-token vocabulary chosen where the target's mass is not.
"""

from __future__ import annotations

import pytest
import torch

from specdecode import verify as verify_module
from specdecode.batch.executor import BatchEngine
from specdecode.batch.scheduler import SchedulerConfig
from distribution_check import (ALPHA, NEW_TOKENS, PROMPT, SAMPLES, SETTINGS, VOCAB, chi_square_p_value, exact_joint,
                                next_probs, sample_counts, small_vocab_model, small_vocab_target)
from specdecode.drafters import DraftModelDrafter, LayerSkipDrafter, NgramDrafter, NgramTreeDrafter
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams, sample
from specdecode.verify import Verdict
from tiny_models import random_head_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> Transformer:
    return small_vocab_target()


def _drafter(kind: str, target: Transformer):
    if kind in ("eagle", "eagle-tree", "eagle3", "medusa"):
        # Draft vocabulary: the target's 4 least likely first tokens, so the head's mass sits where the
        # target's mostly is not; the residual must still restore the target's distribution.
        p1 = next_probs(target, [PROMPT], SamplingParams(temperature=1.0))[0]
        return random_head_drafter(kind, target, vocab=p1.argsort()[:4].tolist(), seed=5)
    if kind == "ngram":
        return NgramDrafter(min_ngram=1, max_ngram=2)
    if kind == "ngram-tree":
        return NgramTreeDrafter(min_ngram=1, max_ngram=2)
    if kind in ("draft", "draft-tree"):
        return DraftModelDrafter(small_vocab_model(11, layers=1), tree_width=3 if kind == "draft-tree" else 0)
    return LayerSkipDrafter(target, skip=[1])


def _chain_cases() -> list:
    """Every setting for every chain drafter; by default (CI time) each setting other than T=1 (which
    test_conformance.py runs for every drafter) once: the deterministic drafter (ngram) at T=0.5, the
    stochastic ones (draft; layerskip, the same rule) with top-k, top-p and both, the rest slow."""
    fast = {("ngram", 1), ("draft", 2), ("draft", 4), ("layerskip", 3)}
    return [pytest.param(kind, s, id=f"{kind}-T{s.temperature}-k{s.top_k}-p{s.top_p}",
                         marks=() if (kind, i) in fast else pytest.mark.slow)
            for kind in ("ngram", "draft", "layerskip") for i, s in enumerate(SETTINGS)]


@pytest.mark.parametrize("kind, sampling", _chain_cases())
def test_speculative_sampling_matches_target_distribution(target, kind, sampling):
    engine = Engine(target, drafter=_drafter(kind, target), spec=SpeculativeConfig(gamma=3))
    counts = sample_counts(engine, sampling)
    p_value = chi_square_p_value(counts, exact_joint(target, sampling))
    assert p_value > ALPHA, f"{kind} at {sampling}: chi-square p = {p_value:.2e}"


def _tree_cases() -> list:
    """One setting of the deterministic tree by default (CI time; both run at T=1 in test_conformance.py), the
    rest slow."""
    fast = {("ngram-tree", 3)}
    return [pytest.param(kind, SETTINGS[i], id=f"{kind}-{i}", marks=() if (kind, i) in fast else pytest.mark.slow)
            for kind in ("draft-tree", "ngram-tree") for i in range(len(SETTINGS))]


@pytest.mark.parametrize("kind, sampling", _tree_cases())
def test_tree_sampling_matches_target_distribution(target, kind, sampling):
    """Trees with up to 6 nodes, three children per expanded node (draft-tree: drawn without replacement,
    recursive rejection; ngram-tree: deterministic, coupled)."""
    engine = Engine(target, drafter=_drafter(kind, target), spec=SpeculativeConfig(gamma=6))
    counts = sample_counts(engine, sampling)
    p_value = chi_square_p_value(counts, exact_joint(target, sampling))
    assert p_value > ALPHA, f"{kind} at {sampling}: chi-square p = {p_value:.2e}"


@pytest.mark.parametrize("kind, sampling", [pytest.param("eagle", SETTINGS[0], marks=pytest.mark.slow),
                                            pytest.param("eagle-tree", SETTINGS[2], marks=pytest.mark.slow),
                                            pytest.param("eagle3", SETTINGS[2], marks=pytest.mark.slow),
                                            ("medusa", SETTINGS[4])],
                         ids=["eagle-T1.0", "eagle-tree-T1.0-k6", "eagle3-T1.0-k6", "medusa-T0.5-p0.9"])
def test_head_drafts_over_a_reduced_vocabulary_keep_the_target_distribution(target, kind, sampling):
    engine = Engine(target, drafter=_drafter(kind, target), spec=SpeculativeConfig(gamma=3))
    counts = sample_counts(engine, sampling)
    p_value = chi_square_p_value(counts, exact_joint(target, sampling))
    assert p_value > ALPHA, f"{kind} at {sampling}: chi-square p = {p_value:.2e}"


def test_drafts_are_actually_verified(target):
    """Guards the tests above: every drafter proposes and gets tokens accepted in this setting (the registered
    ones are checked again by test_conformance.py; eagle3 is a head variant, not a registered drafter)."""
    for kind in ("ngram", "ngram-tree", "draft", "draft-tree", "layerskip", "eagle", "eagle-tree", "eagle3", "medusa"):
        engine = Engine(target, drafter=_drafter(kind, target), spec=SpeculativeConfig(gamma=3))
        drafted = accepted = trees = 0
        for seed in range(50):
            stats = engine.generate(PROMPT, SamplingParams(1.0, seed=seed), NEW_TOKENS, eos_token_ids=()).stats
            drafted += stats.drafted_tokens
            accepted += stats.accepted_tokens
            trees += stats.tree_steps
        assert drafted >= 50 and 0 < accepted < drafted, (kind, drafted, accepted)
        assert trees > 0 if kind in ("draft-tree", "eagle-tree") else trees == 0, (kind, trees)


def _lossy_seed_rule(p, q, draft, generator):
    """The seed document's pseudocode (NOT lossless): accept if p >= q, else sample from p / (1 - q)."""
    for i, token in enumerate(draft):
        if p[i, token] < q[i, token]:
            corrected = p[i] / (1 - q[i]).clamp_min(1e-6)
            return Verdict(i, draft[:i] + [int(sample((corrected / corrected.sum())[None], generator))])
    return Verdict(len(draft), draft + [int(sample(p[len(draft):len(draft) + 1], generator))])


def test_negative_control_detects_the_lossy_seed_rule(target, monkeypatch):
    monkeypatch.setattr(verify_module, "verify_stochastic", _lossy_seed_rule)
    sampling = SamplingParams(temperature=1.0)
    engine = Engine(target, drafter=_drafter("draft", target), spec=SpeculativeConfig(gamma=3))
    p_value = chi_square_p_value(sample_counts(engine, sampling), exact_joint(target, sampling))
    assert p_value < ALPHA, f"the lossy rule went undetected (p = {p_value:.3f})"


class _CutByContent:
    """A controller that drafts 3 tokens and, once the draft is made, keeps none of it where its first token's
    match count (a signal of the draft) is odd: the cut depends on what was drafted."""

    early_stop = True

    def __init__(self) -> None:
        self.signals: list = []
        self.cuts = self.kept = 0

    def next_gamma(self, ctx) -> int:
        self.signals = []
        return 3

    def stop(self, position, signal) -> bool:
        self.signals.append(signal)
        return False

    def keep(self, drafted: int) -> int:
        n = 0 if int(self.signals[0][1]) % 2 else drafted
        self.cuts += n < drafted
        self.kept += n == drafted
        return n

    def update(self, record) -> None:
        pass


def test_deterministic_drafts_cut_by_what_they_hold_keep_the_target_distribution(target):
    """A one-hot draft is a function of the context, so a cut that looks at its tokens (``controller.keep``, as
    ``adaptive`` does in a batch) leaves the distribution exact."""
    from specdecode.control import ControllerFactory

    controller = _CutByContent()
    engine = Engine(target, drafter=_drafter("ngram", target), spec=SpeculativeConfig(gamma=3))
    engine.batch.admission.new_controller = ControllerFactory(lambda _: controller)
    sampling = SamplingParams(temperature=1.0)
    p_value = chi_square_p_value(sample_counts(engine, sampling), exact_joint(target, sampling))
    assert p_value > ALPHA, f"cut one-hot drafts: chi-square p = {p_value:.2e}"
    assert controller.cuts > 0 and controller.kept > 0


@pytest.mark.parametrize("kind, sampling", [("none", SETTINGS[0]), ("ngram", SETTINGS[0]), ("ngram", SETTINGS[3])],
                         ids=["plain-T1.0", "ngram-T1.0", "ngram-T1.0-k8-p0.9"])
def test_batched_sampling_matches_target_distribution(target, kind, sampling):
    """Requests served 4 at a time (different seeds, so different drafts in each step) keep the target's
    distribution, and each request's tokens are those it gets served alone with the same seed."""
    new = (lambda: _drafter("ngram", target)) if kind == "ngram" else None
    engine = BatchEngine(target, new_drafter=new, spec=SpeculativeConfig(gamma=3),
                         scheduler=SchedulerConfig(max_running=4, max_waiting=SAMPLES), max_len=64)
    params = [SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=s) for s in range(SAMPLES)]
    results = engine.run([dict(prompt=PROMPT, sampling=p, max_new_tokens=NEW_TOKENS, eos_token_ids=()) for p in params])
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    p_value = chi_square_p_value(counts, exact_joint(target, sampling))
    assert p_value > ALPHA, f"batched {kind} at {sampling}: chi-square p = {p_value:.2e}"
    solo = Engine(target, drafter=_drafter(kind, target) if new else None, spec=SpeculativeConfig(gamma=3))
    for p, r in list(zip(params, results))[:50]:
        assert solo.generate(PROMPT, p, NEW_TOKENS, eos_token_ids=()).token_ids == r.token_ids, p.seed
    if kind == "ngram":
        assert sum(r.stats.accepted_tokens for r in results) > 100  # drafts were verified, and some kept
