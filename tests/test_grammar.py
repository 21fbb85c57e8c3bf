"""grammar.py and drafters/forced.py without a model: grammars compile or are refused by name, masks follow the
grammar down chains and trees, forced tokens and the cut of drafts the grammar refuses."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import specdecode.grammar as grammar_module
from distribution_check import LETTERS, letter_ids as ids, small_vocab_compiler, small_vocab_tokenizer
from specdecode.drafters.base import Draft, DrafterBase
from specdecode.drafters.forced import ForcedDrafter, within
from specdecode.grammar import Grammar, GrammarCompiler, GrammarError, allowed, mask_rows, sole_tokens

V = 16


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return small_vocab_compiler()


def letters(row: torch.Tensor) -> str:
    return "".join(LETTERS[i] if i < len(LETTERS) else "$" for i in row.nonzero().flatten().tolist())


def test_bad_grammars_are_refused_by_name(compiler):
    with pytest.raises(GrammarError, match="not valid JSON"):
        Grammar.json_schema("{nope")
    with pytest.raises(GrammarError, match="must be an object"):
        Grammar.json_schema("[1]")
    with pytest.raises(GrammarError, match="regex is empty"):
        Grammar.regex("")
    with pytest.raises(GrammarError, match="non-empty strings"):
        Grammar.choice([])
    with pytest.raises(GrammarError, match="regex does not compile"):
        compiler.compile(Grammar.regex("(ab"))
    with pytest.raises(GrammarError, match="json schema does not compile"):
        compiler.compile(Grammar.json_schema({"type": "no-such-type"}))


def test_strict_schemas_refuse_what_cannot_be_enforced(compiler):
    schema = {"type": "string", "format": "no-such-format"}
    with pytest.raises(GrammarError):
        compiler.compile(Grammar.json_schema(schema, strict=True))
    compiler.compile(Grammar.json_schema(schema, strict=False))  # ignored, as OpenAI does without strict


def test_compiled_grammars_are_kept_and_each_request_gets_its_own_place(compiler):
    grammar = Grammar.regex("ab[c-e]")
    first, second = compiler.start(grammar), compiler.start(grammar)
    first.advance(ids("a"))
    assert first.forced() == ids("b") and second.forced() == ids("ab")
    assert sum(source == grammar.source for source in compiler._compiled) == 1


def test_threads_compiling_at_once_each_get_their_own_grammar_and_the_cache_stays_bounded(monkeypatch):
    monkeypatch.setattr(grammar_module, "COMPILED_KEPT", 4)
    tokenizer = small_vocab_tokenizer()
    compiler = GrammarCompiler(tokenizer.backend.to_str(), V, tokenizer.eos_token_ids)
    words = ["".join(LETTERS[(i + j) % 8] for j in range(3)) + LETTERS[i % 5] for i in range(24)]

    def compile_all(offset: int) -> list[list[int]]:
        return [compiler.start(Grammar.choice([w])).forced() for w in words[offset:] + words[:offset]]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(compile_all, [0, 6, 12, 18] * 4))
    for offset, forced in zip([0, 6, 12, 18] * 4, results):
        assert forced == [ids(w) for w in words[offset:] + words[:offset]]
    assert len(compiler._compiled) == 4


def test_chain_masks_follow_the_draft_and_rows_past_a_refused_token_copy_their_parent(compiler):
    constraint = compiler.start(Grammar.regex("[a-c]d[e-g]+"))
    masks = allowed(constraint.masks(ids("bde")), V)
    assert [letters(r) for r in masks] == ["abc", "d", "efg", "efg$"]  # "$": the end is allowed once complete
    masks = allowed(constraint.masks(ids("bae")), V)  # "a" is refused after "b"
    assert [letters(r) for r in masks] == ["abc", "d", "d", "d"]
    assert constraint.valid(ids("bde")) == 3 and constraint.valid(ids("bae")) == 1
    assert constraint.forced() == []  # nothing consumed: masks and checks leave the place where it was


def test_tree_masks_follow_each_path(compiler):
    constraint = compiler.start(Grammar.choice(["abc", "ade", "bbb"]))
    # root -> a (0) -> b (1), a -> d (2) -> e (3); root -> b (4); root -> c (5, refused)
    masks = allowed(constraint.masks(ids("abdebc"), [-1, 0, 0, 2, -1, -1]), V)
    assert [letters(r) for r in masks] == ["ab", "bd", "c", "e", "$", "b", "ab"]


def test_drafts_past_a_completed_grammar_leave_its_place_where_it_was(compiler):
    """A grammar that stops once complete takes an end-of-sequence token without counting it: masks and checks
    past the end must not roll back further than they went."""
    eos = V - 1
    for draft in (ids("ab") + [eos, eos], ids("a")):
        constraint = compiler.start(Grammar.regex("ab"))
        masks = allowed(constraint.masks(draft), V)
        assert letters(masks[0]) == "a" and all(letters(r) == "$" for r in masks[2:])
        assert constraint.forced() == ids("ab") and constraint.until_done(draft) == min(2, len(draft))
        tree = allowed(constraint.masks(ids("ab") + [eos], [-1, 0, 1]), V)
        assert [letters(r) for r in tree] == ["a", "b", "$", "$"]
        assert constraint.forced() == ids("ab") and constraint.valid(ids("ab")) == 2


def test_until_done_cuts_where_the_grammar_completes(compiler):
    constraint = compiler.start(Grammar.choice(["ab", "cd"]))
    eos = V - 1
    assert constraint.until_done(ids("ab") + [eos]) == 2
    assert constraint.until_done(ids("a")) == 1 and not constraint.done
    constraint.advance(ids("ab"))
    assert constraint.done
    with pytest.raises(RuntimeError, match="refused"):
        compiler.start(Grammar.choice(["ab"])).advance(ids("b"))


def test_sole_tokens_are_the_rows_that_allow_exactly_one(compiler):
    constraint = compiler.start(Grammar.regex("ab[c-e]f"))
    assert sole_tokens(constraint.masks(ids("abd"))) == {0: ids("a")[0], 1: ids("b")[0], 3: ids("f")[0]}
    masks = np.zeros((5, 4), dtype=np.uint32)
    masks[0, 2] = 1 << 6  # token 70 alone
    masks[1, 0] = 0b101  # two tokens in one word
    masks[2, 1], masks[2, 3] = 1, 1  # one token in each of two words
    masks[4, 3] = 1 << 31  # token 127 alone: the sign bit of an int32 word
    assert sole_tokens(masks.view(np.int32)) == {0: 70, 4: 127}


def test_mask_rows_sets_minus_infinity_exactly_where_refused(compiler):
    constraint = compiler.start(Grammar.regex("[a-c]d"))
    logits = torch.randn(5, V)
    before = logits.clone()
    mask_rows(logits, 1, constraint.masks(ids("b")))
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[3:], before[3:])
    assert letters(torch.isfinite(logits[1])) == "abc" and letters(torch.isfinite(logits[2])) == "d"
    assert torch.equal(logits[1, :3], before[1, :3])


def test_within_cuts_one_hot_drafts_before_and_sampled_ones_after_the_first_refused_token(compiler):
    constraint = compiler.start(Grammar.regex("[a-c]d[e-g]+"))
    assert within(Draft(ids("bdae")), constraint).tokens == ids("bd")
    q = torch.softmax(torch.randn(4, V), -1)
    cut = within(Draft(ids("bdae"), q), constraint)
    assert cut.tokens == ids("bda") and torch.equal(cut.q, q[:3])
    tree = Draft(ids("ab"), parents=[-1, -1])
    assert within(tree, constraint) is tree
    assert within(Draft(ids("bde")), constraint).tokens == ids("bde")


class _Fixed(DrafterBase):
    """Proposes a fixed chain or tree, with a q when given; remembers the sequence it was asked after."""

    name, signal_names = "fixed", ()
    drafts_past_unverified = True

    def __init__(self, tokens, q=None, parents=None):
        self.tokens, self.q, self.parents, self.asked = tokens, q, parents, None

    def propose(self, seq, k, sampling, generator, stop=None):
        self.asked = list(seq)
        return Draft(self.tokens[:k], None if self.q is None else self.q[:k], parents=self.parents)


def test_forced_tokens_lead_the_draft_and_the_inner_drafter_follows_them(compiler):
    constraint = compiler.start(Grammar.regex("ab[c-e]+"))
    q = torch.softmax(torch.randn(2, V), -1)
    inner = _Fixed(ids("cd"), q)
    drafter = ForcedDrafter(constraint, inner)
    drafter.reset(None, [5])
    draft = drafter.propose([5], 4, None, None)
    assert draft.tokens == ids("abcd") and draft.forced == 2 and inner.asked == [5] + ids("ab")
    assert torch.equal(draft.q[:2], torch.nn.functional.one_hot(torch.tensor(ids("ab")), V).float())
    assert torch.equal(draft.q[2:], q)
    drafter.commit([5] + ids("ab") + ids("e"))
    tree = ForcedDrafter(compiler.start(Grammar.regex("ab[c-e]+")), _Fixed(ids("cdd"), parents=[-1, -1, 0]))
    tree.reset(None, [5])
    draft = tree.propose([5], 5, None, None)
    assert draft.tokens == ids("abcdd") and draft.parents == [-1, 0, 1, 1, 2]
    only = ForcedDrafter(compiler.start(Grammar.regex("ab[c-e]+")), _Fixed(ids("cd")))
    only.wrapped.drafts_past_unverified = False
    only.reset(None, [5])
    assert only.propose([5], 4, None, None).tokens == ids("ab")
