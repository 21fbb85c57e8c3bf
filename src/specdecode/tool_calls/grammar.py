"""Grammars for tool calls, so that a call is constrained by its tool's schema while it is written (and its forced
text is drafted for free):

- ``required`` (or a named function): the reply is one call (or, with parallel calls, several) and nothing else;
- ``auto``: free text, or free text up to the family's opener and calls after it — a *lazy* grammar that
  constrains nothing until the model opens a call, so that an answer in words stays as the model wrote it.

An opener or closer that is one added token of the tokenizer (Qwen's ``<tool_call>``) is named as a special token
(``<[id]>``: llguidance will not spell it). A format without an opener (Llama 3's bare JSON) is constrained under ``auto``
only when the reply starts with ``{``. It does not parse replies (``formats.py``) or mask logits (``grammar.py``).
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

import llguidance

from specdecode.grammar import JSON_OPTIONS, Grammar, GrammarError
from specdecode.tool_calls.formats import CallFormat, Function


def _regex_text(text: str) -> str:
    """``text`` as a literal inside a lark ``/.../`` regex."""
    return "".join("\\" + c if c in r"\/.^$|?*+()[]{}-" else {"\n": "\\n", "\t": "\\t"}.get(c, c) for c in text)


def _marker(text: str, special_id: Callable[[str], int | None]) -> str:
    """A lark expression for ``text``: a string literal, or the token by id (``<[id]>``) with its whitespace around
    it where the text less its whitespace is one special token."""
    core = text.strip()
    token = special_id(core) if core else None
    if token is None:
        return json.dumps(text)  # a lark string literal (JSON's escapes are lark's)
    before, after = text[:text.index(core)], text[text.index(core) + len(core):]
    return " ".join(part for part in (json.dumps(before) if before else "", f"<[{token}]>",
                                      json.dumps(after) if after else "") if part)


def call_grammar(fmt: CallFormat, functions: Sequence[Function], parallel: bool, lazy: bool,
                 special_id: Callable[[str], int | None] = lambda text: None) -> Grammar:
    """The grammar of replies that call ``functions`` in ``fmt``: only calls (``lazy`` False), or free text with
    calls after the first opener (``lazy`` True, for ``tool_choice`` auto). ``special_id`` names the tokenizer's
    special tokens (``GrammarCompiler.special_id``).

    Raises:
        GrammarError: no functions, or a schema llguidance refuses.
    """
    if not functions:
        raise GrammarError("tool calls need at least one function")
    options = {**JSON_OPTIONS, "lenient": not all(f.strict for f in functions)}
    schema = {**fmt.call_schema(functions), "x-guidance": options}
    if fmt.as_list:
        schema = {"type": "array", "items": fmt.call_schema(functions), "minItems": 1,
                  **({} if parallel else {"maxItems": 1}), "x-guidance": options}
    closer = f" {_marker(fmt.closer, special_id)}" if fmt.closer else ""
    opener = _marker(fmt.opener, special_id) if fmt.opener else ""
    rules = [f"body: %json {json.dumps(schema)}{closer}", f"call: {opener} body" if opener else "call: body"]
    more = f"({json.dumps(fmt.separator)} call)*" if parallel and not fmt.as_list else ""
    spelled = _regex_text(fmt.opener)
    if not lazy:
        rules.insert(0, f"start: call {more}")
    elif not fmt.opener:
        rules[:0] = [f"start: TEXT | call {more}", "TEXT: /[^{](?s:.*)/"]
    elif "<[" in opener:  # a special token ends any text lexeme by itself
        rules[:0] = [f"start: TEXT | TEXT? call {more}", f"TEXT: /(?s:.+)/ & ~/(?s:.*{_regex_text(fmt.opener.strip())}.*)/"]
    else:
        rules[:0] = [f"start: TEXT | OPEN body {more}",
                     # text that never holds the opener; or text up to the first opener, which ends the lexeme
                     f"TEXT: /(?s:.+)/ & ~/(?s:.*{spelled}.*)/",
                     f"OPEN: /(?s:.*){spelled}/ & ~/(?s:.*{spelled}.*{spelled}.*)/"]
    try:
        return Grammar(llguidance.LLMatcher.grammar_from_lark("\n".join(rules)), "tool_calls")
    except (ValueError, UnicodeError) as exc:
        raise GrammarError(f"the tools cannot be compiled: {exc}") from None
