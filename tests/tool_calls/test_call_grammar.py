"""tool_calls/grammar.py compiled for the real SmolLM2 tokenizer: the ``required`` grammar takes well-formed calls to
the offered functions and nothing else (one call without parallel calls) and forces the opener and the name's
start (the whole name for one function); the lazy ``auto`` grammar takes free text, text ending in a well-formed
call and a partial opener, and refuses a malformed call; Llama 3's lazy grammar constrains only replies that start
with "{"; Mistral's takes its list of calls. An opener that is one special token is named by id.

(``test_call_grammar``, not ``test_grammar``: tests/test_grammar.py holds that module name.)"""

from __future__ import annotations

import pytest

from specdecode.grammar import GrammarCompiler, GrammarError
from specdecode.tool_calls.formats import HERMES, LLAMA3, MISTRAL, Call, Function
from specdecode.tool_calls.grammar import call_grammar

pytestmark = pytest.mark.integration

ADD = Function("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]})
WEATHER = Function("get_weather", {"type": "object", "properties": {"city": {"type": "string"},
                                                                     "unit": {"enum": ["c", "f"]}},
                                   "required": ["city"]})
FUNCTIONS = [ADD, WEATHER]
GOOD = Call("add", '{"a": 1, "b": 2}')
ALSO_GOOD = Call("get_weather", '{"city": "Zürich", "unit": "c"}')
UNKNOWN = Call("sub", '{"a": 1, "b": 2}')
MISSING = Call("add", '{"a": 1}')
WRONG_TYPE = Call("add", '{"a": "1", "b": 2}')
BAD_ENUM = Call("get_weather", '{"city": "Rome", "unit": "k"}')
STAND_IN = "<repo_name>"  # a special token of SmolLM2's, standing in for an opener that is one special token


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="module")
def compiler(smollm2, tok):
    return GrammarCompiler(tok.backend.to_str(), smollm2.model.config.vocab_size, [tok.eos_token_id])


def taken(compiler, tok, grammar, text: str) -> tuple[int, int]:
    """How many of ``text``'s tokens the grammar allows in a row, of how many."""
    ids = tok.encode(text)
    return compiler.compile(grammar).validate_tokens(ids), len(ids)


def accepts(compiler, tok, grammar, text: str) -> bool:
    """The grammar allows all of ``text`` and may end after it."""
    ids = tok.encode(text)
    matcher = compiler.compile(grammar)
    if matcher.validate_tokens(ids) != len(ids):
        return False
    assert matcher.consume_tokens(ids)
    return matcher.is_accepting()


def ends_after(compiler, tok, grammar, text: str) -> bool:
    """The end-of-sequence token is allowed right after ``text``."""
    matcher = compiler.compile(grammar)
    assert matcher.consume_tokens(tok.encode(text))
    return matcher.validate_tokens([tok.eos_token_id]) == 1


def refused_where_it_departs(compiler, tok, grammar, bad: str, good: str) -> bool:
    """``bad`` is refused at its first token that differs from ``good``'s (which the grammar accepts)."""
    bad_ids, good_ids = tok.encode(bad), tok.encode(good)
    same = next(i for i, (x, y) in enumerate(zip(bad_ids, good_ids)) if x != y)
    return compiler.compile(grammar).validate_tokens(bad_ids) == same


def stand_in(text: str) -> str:
    return text.replace("<tool_call>", STAND_IN)


def test_no_functions_is_an_error():
    with pytest.raises(GrammarError, match="at least one function"):
        call_grammar(HERMES, [], parallel=True, lazy=False)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=lambda f: f.family)
@pytest.mark.parametrize("lazy", [False, True], ids=["required", "auto"])
def test_every_grammar_compiles_for_the_real_tokenizer(compiler, fmt, lazy):
    for parallel in (False, True):
        matcher = compiler.compile(call_grammar(fmt, FUNCTIONS, parallel, lazy, compiler.special_id))
        assert not matcher.is_error()


def test_required_takes_a_call_and_then_may_end(compiler, tok):
    required = call_grammar(HERMES, FUNCTIONS, parallel=True, lazy=False, special_id=compiler.special_id)
    for calls in ([GOOD], [ALSO_GOOD], [GOOD, ALSO_GOOD], [ALSO_GOOD, GOOD, GOOD]):
        text = HERMES.write(calls)
        assert accepts(compiler, tok, required, text), text
        assert ends_after(compiler, tok, required, text)


def test_required_refuses_calls_its_schemas_do_not_allow(compiler, tok):
    required = call_grammar(HERMES, FUNCTIONS, parallel=True, lazy=False, special_id=compiler.special_id)
    rome = Call("get_weather", '{"city": "Rome", "unit": "c"}')
    for bad, good in ((UNKNOWN, GOOD), (MISSING, GOOD), (WRONG_TYPE, GOOD), (BAD_ENUM, rome)):
        assert not accepts(compiler, tok, required, HERMES.write([bad]))
        assert refused_where_it_departs(compiler, tok, required, HERMES.write([bad]), HERMES.write([good])), bad


def test_required_refuses_free_text_and_an_unclosed_call(compiler, tok):
    required = call_grammar(HERMES, FUNCTIONS, parallel=True, lazy=False, special_id=compiler.special_id)
    assert taken(compiler, tok, required, "The answer is 3.") == (0, len(tok.encode("The answer is 3.")))
    assert taken(compiler, tok, required, "Sure. " + HERMES.write([GOOD]))[0] == 0
    text = HERMES.write([GOOD])
    assert not accepts(compiler, tok, required, text[:-len("</tool_call>")])
    assert not accepts(compiler, tok, required, "")


def test_without_parallel_calls_a_second_call_is_refused(compiler, tok):
    single = call_grammar(HERMES, FUNCTIONS, parallel=False, lazy=False, special_id=compiler.special_id)
    assert accepts(compiler, tok, single, HERMES.write([GOOD]))
    allowed, total = taken(compiler, tok, single, HERMES.write([GOOD, ALSO_GOOD]))
    assert len(tok.encode(HERMES.write([GOOD]))) <= allowed < total  # the first call whole, not the second
    matcher = compiler.compile(single)
    assert matcher.consume_tokens(tok.encode(HERMES.write([GOOD])))
    assert matcher.is_stopped() or matcher.validate_tokens(tok.encode("\n<tool_call>")) < 2


def test_the_opener_and_the_name_start_are_forced(compiler, tok):
    constraint = compiler.start(call_grammar(HERMES, FUNCTIONS, parallel=True, lazy=False,
                                             special_id=compiler.special_id))
    assert tok.decode(constraint.forced()).startswith('<tool_call>\n{"name": "')
    assert not tok.decode(constraint.forced()).startswith('<tool_call>\n{"name": "add')  # two names to choose from


def test_one_function_forces_its_name_too(compiler, tok):
    for function in (ADD, WEATHER):
        constraint = compiler.start(call_grammar(HERMES, [function], parallel=False, lazy=False,
                                                 special_id=compiler.special_id))
        forced = tok.decode(constraint.forced())
        assert forced.startswith(f'<tool_call>\n{{"name": "{function.name}", "arguments": {{'), forced


def test_forced_tokens_advance_with_the_call(compiler, tok):
    constraint = compiler.start(call_grammar(HERMES, FUNCTIONS, parallel=True, lazy=False,
                                             special_id=compiler.special_id))
    text = HERMES.write([ALSO_GOOD])
    upto = text.index("get_") + len("get_")
    constraint.advance(tok.encode(text[:upto]))
    assert tok.decode(constraint.forced()).startswith('weather", "arguments": {"city":')


def test_lazy_takes_plain_text_and_then_may_end(compiler, tok):
    auto = call_grammar(HERMES, FUNCTIONS, parallel=True, lazy=True, special_id=compiler.special_id)
    for text in ("The answer is 3.", "Use {braces} and <b>tags</b>:\n\n- one\n- two", "ok"):
        assert accepts(compiler, tok, auto, text), text
        assert ends_after(compiler, tok, auto, text), text
    assert compiler.start(auto).forced() == []  # nothing forced before the model opens a call


@pytest.mark.parametrize("text", ["a <tool", "a <tool is not a tag", "<tool_", "see <tool_call and <tool_cal> here",
                                  "x </tool_call> y"])
def test_lazy_takes_text_with_a_partial_opener(compiler, tok, text):
    auto = call_grammar(HERMES, FUNCTIONS, parallel=True, lazy=True, special_id=compiler.special_id)
    assert accepts(compiler, tok, auto, text)


def test_lazy_takes_a_call_from_the_first_character(compiler, tok):
    auto = call_grammar(HERMES, FUNCTIONS, parallel=True, lazy=True, special_id=compiler.special_id)
    for calls in ([GOOD], [GOOD, ALSO_GOOD]):
        assert accepts(compiler, tok, auto, HERMES.write(calls))
        assert ends_after(compiler, tok, auto, HERMES.write(calls))
    assert refused_where_it_departs(compiler, tok, auto, HERMES.write([UNKNOWN]), HERMES.write([GOOD]))


@pytest.mark.parametrize("space", [" ", "\n"])
def test_lazy_takes_text_then_a_call(compiler, tok, space):
    auto = call_grammar(HERMES, FUNCTIONS, parallel=True, lazy=True, special_id=compiler.special_id)
    text = "Let me add those." + space + HERMES.write([GOOD, ALSO_GOOD])
    assert accepts(compiler, tok, auto, text)


@pytest.mark.parametrize("bad", [UNKNOWN, MISSING, WRONG_TYPE])
def test_lazy_refuses_text_then_a_malformed_call(compiler, tok, bad):
    auto = call_grammar(HERMES, FUNCTIONS, parallel=True, lazy=True, special_id=compiler.special_id)
    assert not accepts(compiler, tok, auto, "Let me add those. " + HERMES.write([bad]))
    assert not accepts(compiler, tok, auto, "Let me add those. " + HERMES.write([GOOD])[:-3])  # unclosed


def test_a_special_token_opener_is_named_by_id(compiler, tok):
    special_id = {"<tool_call>": compiler.special_id(STAND_IN)}.get
    assert special_id("<tool_call>") is not None
    required = call_grammar(HERMES, [ADD], parallel=False, lazy=False, special_id=special_id)
    forced = compiler.start(required).forced()
    assert forced[0] == special_id("<tool_call>")
    assert tok.decode(forced, skip_special_tokens=False).startswith(STAND_IN + '\n{"name": "add", "arguments": {')
    assert accepts(compiler, tok, required, stand_in(HERMES.write([GOOD])))
    assert not accepts(compiler, tok, required, HERMES.write([GOOD]))  # the opener spelled is not the token


def test_lazy_with_a_special_token_opener_takes_text_then_a_call(compiler, tok):
    special_id = {"<tool_call>": compiler.special_id(STAND_IN)}.get
    auto = call_grammar(HERMES, FUNCTIONS, parallel=True, lazy=True, special_id=special_id)
    good = stand_in("Let me add those.\n" + HERMES.write([GOOD, ALSO_GOOD]))
    assert accepts(compiler, tok, auto, good)
    assert ends_after(compiler, tok, auto, good)
    # the opener spelled out would read back as one (parse() sees the same text), so plain text may not hold it
    assert not accepts(compiler, tok, auto, "Plain text with <tool_call> spelled out.")
    assert accepts(compiler, tok, auto, "Plain text with <tool_call spelled out.")
    assert accepts(compiler, tok, auto, stand_in(HERMES.write([GOOD])))
    bad = stand_in("Let me add those.\n" + HERMES.write([UNKNOWN]))
    assert refused_where_it_departs(compiler, tok, auto, bad, stand_in("Let me add those.\n" + HERMES.write([GOOD])))


def test_llama3_lazy_leaves_text_alone_and_constrains_a_reply_that_starts_with_a_brace(compiler, tok):
    auto = call_grammar(LLAMA3, FUNCTIONS, parallel=True, lazy=True, special_id=compiler.special_id)
    for text in ("The answer is 3.", "hello {x}", 'Say "{"', "a"):
        assert accepts(compiler, tok, auto, text), text
        assert ends_after(compiler, tok, auto, text), text
    for calls in ([GOOD], [GOOD, ALSO_GOOD]):
        assert accepts(compiler, tok, auto, LLAMA3.write(calls))
    assert not accepts(compiler, tok, auto, '{"x": 1}')
    assert not accepts(compiler, tok, auto, '{"name": "add", "arguments": {"a": 1, "b": 2}}')  # Llama's key
    assert refused_where_it_departs(compiler, tok, auto, LLAMA3.write([UNKNOWN]), LLAMA3.write([GOOD]))
    assert refused_where_it_departs(compiler, tok, auto, LLAMA3.write([MISSING]), LLAMA3.write([GOOD]))


def test_llama3_required_refuses_text(compiler, tok):
    required = call_grammar(LLAMA3, FUNCTIONS, parallel=False, lazy=False, special_id=compiler.special_id)
    assert accepts(compiler, tok, required, LLAMA3.write([GOOD]))
    assert not accepts(compiler, tok, required, "The answer is 3.")
    assert not accepts(compiler, tok, required, LLAMA3.write([GOOD, GOOD]))


def test_mistral_required_takes_its_list_of_calls(compiler, tok):
    parallel = call_grammar(MISTRAL, FUNCTIONS, parallel=True, lazy=False, special_id=compiler.special_id)
    for calls in ([GOOD], [GOOD, ALSO_GOOD], [ALSO_GOOD, GOOD, GOOD]):
        assert accepts(compiler, tok, parallel, MISTRAL.write(calls)), calls
    assert not accepts(compiler, tok, parallel, "[TOOL_CALLS][]")
    assert not accepts(compiler, tok, parallel, "The answer is 3.")
    assert refused_where_it_departs(compiler, tok, parallel, MISTRAL.write([UNKNOWN]), MISTRAL.write([GOOD]))
    assert refused_where_it_departs(compiler, tok, parallel, MISTRAL.write([GOOD, MISSING]),
                                    MISTRAL.write([GOOD, GOOD]))
    single = call_grammar(MISTRAL, FUNCTIONS, parallel=False, lazy=False, special_id=compiler.special_id)
    assert accepts(compiler, tok, single, MISTRAL.write([ALSO_GOOD]))
    assert not accepts(compiler, tok, single, MISTRAL.write([GOOD, ALSO_GOOD]))


def test_mistral_lazy_takes_plain_text(compiler, tok):
    auto = call_grammar(MISTRAL, FUNCTIONS, parallel=True, lazy=True, special_id=compiler.special_id)
    for text in ("The answer is 3.", "a [b] c", "see [TOOL"):
        assert accepts(compiler, tok, auto, text), text
        assert ends_after(compiler, tok, auto, text), text


@pytest.mark.parametrize("before", ["", "Sure. "])
def test_mistral_lazy_takes_a_call_after_a_spelled_opener(compiler, tok, before):
    auto = call_grammar(MISTRAL, FUNCTIONS, parallel=True, lazy=True, special_id=compiler.special_id)
    assert accepts(compiler, tok, auto, before + MISTRAL.write([GOOD, ALSO_GOOD]))


def test_mistral_lazy_with_a_special_token_opener_takes_calls(compiler, tok):
    special_id = {"[TOOL_CALLS]": compiler.special_id(STAND_IN)}.get
    auto = call_grammar(MISTRAL, FUNCTIONS, parallel=True, lazy=True, special_id=special_id)
    for before in ("", "Sure. "):
        text = before + MISTRAL.write([GOOD, ALSO_GOOD]).replace("[TOOL_CALLS]", STAND_IN)
        assert accepts(compiler, tok, auto, text), text
    assert accepts(compiler, tok, auto, "Plain text.")
    assert not accepts(compiler, tok, auto, MISTRAL.write([UNKNOWN]).replace("[TOOL_CALLS]", STAND_IN))
