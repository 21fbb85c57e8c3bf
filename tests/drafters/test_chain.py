"""drafters/chain.py: a request's drafter chain is built from what the request brings (a prediction, a grammar),
drafts through its outermost link, answers for its links by name, and leaves the slot's drafter as it was."""

from __future__ import annotations

import pytest

from distribution_check import letter_ids as ids, small_vocab_compiler
from specdecode.drafters.base import Draft, DrafterBase
from specdecode.drafters.chain import PredictionCounts, chain_for
from specdecode.drafters.forced import ForcedDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.prediction import Prediction, PredictionDrafter
from specdecode.grammar import Grammar, GrammarCompiler


class _Echo(DrafterBase):
    """Drafts ``k`` copies of 7 and counts what it is told."""

    name, signal_names = "echo", ()
    drafts_past_unverified = True

    def __init__(self) -> None:
        self.commits = 0

    def propose(self, seq, k, sampling, generator, stop=None):
        return Draft([7] * k)

    def commit(self, seq):
        self.commits += 1


def _prediction(ids) -> Prediction:
    ids = tuple(ids)
    return Prediction("", ids, tuple(range(1, len(ids) + 1)))


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return small_vocab_compiler()


def test_nothing_drafts_without_a_slot_drafter_or_a_prediction(compiler):
    assert chain_for(None) is None
    assert chain_for(None, constraint=compiler.start(Grammar.regex("ab[c-e]+"))) is None  # speculation off: no forced drafts


def test_a_request_that_adds_nothing_drafts_with_the_slot_drafter_itself():
    slot = _Echo()
    chain = chain_for(slot)
    assert chain.wrapped is slot and chain.slot_drafter is slot and chain.prediction is None and chain.forced is None
    assert chain.name == "echo" and chain.forced_ahead() == 0 and chain.prediction_counts() is None
    assert chain.propose([1], 3, None, None).tokens == [7, 7, 7]
    chain.commit([1, 7])
    assert slot.commits == 1


def test_a_prediction_goes_in_front_of_the_slot_drafter_and_reports_its_counts():
    slot = _Echo()
    chain = chain_for(slot, prediction=_prediction([40, 41, 42, 43]))
    assert isinstance(chain.wrapped, PredictionDrafter) and chain.wrapped is chain.prediction
    assert chain.prediction.wrapped is slot
    chain.reset(None, [1])
    assert chain.propose([1], 3, None, None).tokens == [40, 41, 42]
    chain.commit([1, 40, 41, 9])  # two kept, then the output departs
    assert chain.prediction_counts() == PredictionCounts(tokens=4, drafted=3, accepted=2)
    assert slot.commits == 1  # the slot's drafter is told too


def test_a_prediction_drafts_even_with_speculation_off():
    chain = chain_for(None, prediction=_prediction([40, 41]))
    assert chain.slot_drafter is None and chain.name == "prediction"
    chain.reset(None, [1])
    assert chain.propose([1], 5, None, None).tokens == [40, 41]


def test_a_grammar_drafts_its_forced_tokens_outermost(compiler):
    slot = NgramDrafter()
    chain = chain_for(slot, prediction=_prediction(ids("cd")), constraint=compiler.start(Grammar.regex("ab[c-e]+")))
    assert isinstance(chain.wrapped, ForcedDrafter) and chain.wrapped is chain.forced
    assert chain.forced.wrapped is chain.prediction and chain.prediction.wrapped is slot
    chain.reset(None, [5])
    assert chain.forced_ahead() == 2
    draft = chain.propose([5], 4, None, None)
    assert draft.tokens[:2] == ids("ab") and draft.forced == 2


def test_chains_of_two_requests_share_nothing_but_the_slot_drafter():
    slot = _Echo()
    first, second = chain_for(slot, prediction=_prediction([1, 2])), chain_for(slot)
    assert first.prediction is not None and second.prediction is None and second.wrapped is slot


def test_past_forced_tokens_the_prediction_drafts_where_they_follow_it(compiler):
    grammar = compiler.start(Grammar.regex("ab[c-e]+"))
    chain = chain_for(_Echo(), prediction=_prediction(ids("abcd")), constraint=grammar)
    chain.reset(None, [5])
    draft = chain.propose([5], 4, None, None)
    assert draft.tokens == ids("abcd") and draft.forced == 2  # "ab" forced, then the prediction's place after them
    chain.commit([5, *ids("abc"), *ids("e")])  # the forced pair and "c" kept, then the output departs
    assert chain.prediction_counts() == PredictionCounts(tokens=4, drafted=2, accepted=1)


def test_past_forced_tokens_that_leave_the_prediction_the_slot_drafter_drafts(compiler):
    grammar = compiler.start(Grammar.regex("ab[c-e]+"))
    chain = chain_for(_Echo(), prediction=_prediction(ids("cdcd")), constraint=grammar)
    chain.reset(None, [5])
    assert chain.propose([5], 4, None, None).tokens == [*ids("ab"), 7, 7]  # the prediction has nothing after "ab"
    grammar = compiler.start(Grammar.regex("ab[c-e]+"))
    lone = chain_for(None, prediction=_prediction(ids("cdcd")), constraint=grammar)
    lone.reset(None, [5])
    assert lone.propose([5], 4, None, None).tokens == ids("ab")  # and without one, the forced tokens alone
