"""Tool calls are decoded exactly: under a tool grammar (``required``, a named function, ``auto``'s lazy grammar)
greedy speculation gives plain constrained greedy decoding's tokens, alone and batched, with each drafter that serves
it (n-gram, suffix; the grammar's forced tokens drafted ahead of them); seeded sampling gives the same tokens in any
batch; and ``auto`` decodes free text exactly as no grammar would. On the real SmolLM2 (a tokenizer that writes
JSON)."""

from __future__ import annotations

import json

import pytest

from specdecode.batch.executor import BatchEngine
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.control.config import SpeculativeConfig
from specdecode.drafters import NgramDrafter, SuffixDrafter
from specdecode.sampling import SamplingParams
from specdecode.tool_calls.formats import HERMES, Function
from specdecode.tool_calls.grammar import call_grammar

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

FUNCTIONS = [Function("add", {"type": "object", "required": ["a", "b"],
                              "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}),
             Function("get_weather", {"type": "object", "required": ["city"],
                                      "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}})]
QUESTIONS = ["What is 2 plus 3?", "What is the weather in Paris?", "Add 40 and 2, then tell me the weather in Rome."]
NEW_TOKENS = 48
GRAMMARS = {"required": call_grammar(HERMES, FUNCTIONS, parallel=True, lazy=False),
            "named": call_grammar(HERMES, FUNCTIONS[1:], parallel=False, lazy=False),
            "auto": call_grammar(HERMES, FUNCTIONS, parallel=True, lazy=True)}


@pytest.fixture(scope="module")
def prompts(smollm2):
    tok = smollm2.tokenizer
    system = "You can call these functions:\n" + "\n".join(json.dumps(f.as_openai()) for f in FUNCTIONS) + \
        '\nCall one as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>'
    return [tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                {"role": "user", "content": q}])) for q in QUESTIONS]


def _engine(smollm2, drafter: str, running: int) -> BatchEngine:
    new = {"none": None, "ngram": NgramDrafter, "suffix": SuffixDrafter}[drafter]
    return BatchEngine(smollm2.model, smollm2.tokenizer, new, SpeculativeConfig(gamma=6),
                       scheduler=SchedulerConfig(max_running=running, max_rows=32), max_len=1024)


def _run(engine: BatchEngine, prompts, grammar, sampling=SamplingParams(temperature=0.0)):
    results = engine.run([dict(prompt=p, max_new_tokens=NEW_TOKENS, grammar=grammar, sampling=sampling)
                          for p in prompts])
    return [r.token_ids for r in results], sum(r.stats.accepted_tokens for r in results)


# n-gram under every grammar; suffix decoding under auto's, the others with `-m slow`.
@pytest.mark.parametrize("kind, drafter", [(kind, "ngram") for kind in GRAMMARS] + [
    pytest.param(kind, "suffix", marks=[] if kind == "auto" else pytest.mark.slow) for kind in GRAMMARS])
def test_greedy_tool_calls_are_plain_constrained_greedy_alone_and_batched(smollm2, prompts, kind, drafter):
    grammar = GRAMMARS[kind]
    plain, _ = _run(_engine(smollm2, "none", 1), prompts, grammar)
    alone, accepted = _run(_engine(smollm2, drafter, 1), prompts, grammar)
    batched, _ = _run(_engine(smollm2, drafter, len(prompts)), prompts, grammar)
    assert alone == plain and batched == plain, (kind, drafter)
    assert accepted > 0
    if kind != "auto":  # every reply is calls, and those closed before the budget ran out parse
        for tokens in plain:
            text = smollm2.tokenizer.decode(tokens)
            assert text.startswith(HERMES.opener), text
            if HERMES.closer in text:
                assert HERMES.parse(text[:text.rindex(HERMES.closer) + len(HERMES.closer)]) is not None, text


def test_auto_decodes_free_text_exactly_as_no_grammar(smollm2):
    """With no opener in the reply, auto's lazy grammar masks nothing that plain decoding would pick."""
    tok = smollm2.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("Hi! How are you?", "Name three rivers.")]
    free, _ = _run(_engine(smollm2, "none", 1), prompts, None)
    assert all(HERMES.opener not in tok.decode(t) for t in free)
    constrained, _ = _run(_engine(smollm2, "ngram", 2), prompts, GRAMMARS["auto"])
    assert constrained == free


def test_seeded_sampled_tool_calls_depend_only_on_the_seed(smollm2, prompts):
    grammar = GRAMMARS["required"]
    sampling = SamplingParams(temperature=0.7, seed=7)
    alone, _ = _run(_engine(smollm2, "ngram", 1), prompts, grammar, sampling)
    batched, _ = _run(_engine(smollm2, "ngram", len(prompts)), prompts, grammar, sampling)
    assert alone == batched
    for tokens in alone:
        assert smollm2.tokenizer.decode(tokens).startswith(HERMES.opener)
