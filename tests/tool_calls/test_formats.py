"""tool_calls/formats.py: each family's written calls read back as they were written (nested, unicode and empty
arguments, parallel calls), the content before the first call kept (None when only whitespace), malformed replies
read as plain text (None), and the family a chat template's text picks."""

from __future__ import annotations

import json

import pytest

from specdecode.tool_calls.formats import (FORMATS, HERMES, LLAMA3, MISTRAL, Call, Function, Parsed, format_for,
                                           template_knows_tools)

CALLS = (Call("add", '{"a": 1, "b": 2}'),
         Call("get_weather", '{"city": "Zürich", "when": {"days": [1, 2], "hours": {"from": 9, "to": null}}}'),
         Call("noop", "{}"),
         Call("say", '{"text": "日本語 – \\"quoted\\" {braces} [brackets] </tool_call>?", "ok": true, "n": -1.5}'))


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=lambda f: f.family)
@pytest.mark.parametrize("calls", [CALLS[:1], CALLS[1:2], CALLS[2:3], CALLS[:3]],
                         ids=["add", "nested", "empty", "three"])
def test_written_calls_parse_back_as_written(fmt, calls):
    text = fmt.write(calls)
    assert fmt.parse(text) == Parsed(None, tuple(calls))


def test_unicode_is_written_as_itself_and_read_back():
    for fmt in FORMATS.values():
        text = fmt.write([CALLS[1]])
        assert "Zürich" in text and "\\u" not in text
        assert json.loads(fmt.parse(text).calls[0].arguments)["city"] == "Zürich"


def test_each_family_writes_its_own_form():
    add = [CALLS[0]]
    assert HERMES.write(add) == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert LLAMA3.write(add * 2) == '{"name": "add", "parameters": {"a": 1, "b": 2}}; ' \
                                    '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert MISTRAL.write(add) == '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'


def test_a_string_of_special_characters_inside_arguments_does_not_end_the_call():
    # The say call's text holds "</tool_call>" and braces: only the JSON decoder decides where a call ends.
    for fmt in FORMATS.values():
        assert fmt.parse(fmt.write(CALLS)) == Parsed(None, CALLS)


def test_content_before_the_first_call_is_kept():
    text = "Let me look that up.\n" + HERMES.write(CALLS[:2])
    assert HERMES.parse(text) == Parsed("Let me look that up.\n", CALLS[:2])
    assert MISTRAL.parse("Sure. " + MISTRAL.write(CALLS[:1])) == Parsed("Sure. ", CALLS[:1])


@pytest.mark.parametrize("space", ["", " ", "\n\n", " \t\n "])
def test_content_of_only_whitespace_is_none(space):
    assert HERMES.parse(space + HERMES.write(CALLS[:1])) == Parsed(None, CALLS[:1])
    assert LLAMA3.parse(space + LLAMA3.write(CALLS[:1])) == Parsed(None, CALLS[:1])
    assert MISTRAL.parse(space + MISTRAL.write(CALLS[:1])) == Parsed(None, CALLS[:1])


def test_whitespace_between_and_after_calls_is_allowed():
    text = "<tool_call>\n{\"name\": \"noop\", \"arguments\": {}}\n</tool_call>\n\n<tool_call>{\"name\": \"noop\", " \
           "\"arguments\": {}}</tool_call>\n"
    assert HERMES.parse(text) == Parsed(None, (CALLS[2], CALLS[2]))


def test_compact_arguments_read_back_in_one_form():
    text = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'
    assert HERMES.parse(text) == Parsed(None, (CALLS[0],))


def test_a_missing_arguments_object_reads_as_empty_arguments():
    assert HERMES.parse('<tool_call>\n{"name": "noop"}\n</tool_call>') == Parsed(None, (Call("noop", "{}"),))


def test_plain_text_holds_no_call():
    for fmt in FORMATS.values():
        assert fmt.parse("The answer is 42.") is None
        assert fmt.parse("") is None
    assert LLAMA3.parse("Here: " + LLAMA3.write(CALLS[:1])) is None  # Llama's calls are the whole reply


MALFORMED = {
    "unclosed json": ['<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>',
                      '{"name": "add", "parameters": {"a": 1}',
                      '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}'],
    "no name": ['<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
                '{"parameters": {"a": 1}}',
                '[TOOL_CALLS][{"arguments": {"a": 1}}]'],
    "name not a string": ['<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
                          '{"name": ["add"], "parameters": {}}',
                          '[TOOL_CALLS][{"name": null, "arguments": {}}]'],
    "arguments not an object": ['<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
                                '{"name": "add", "parameters": [1, 2]}',
                                '[TOOL_CALLS][{"name": "add", "arguments": 7}]'],
    "call not an object": ['<tool_call>\n["add", {}]\n</tool_call>',
                           '{"name": "add", "parameters": {}}; "add"',
                           '[TOOL_CALLS]["add"]'],
    "text after the calls": [HERMES.write(CALLS[:1]) + "\nI called it.",
                             LLAMA3.write(CALLS[:1]) + " I called it.",
                             MISTRAL.write(CALLS[:1]) + " I called it."],
    "second call unclosed": [HERMES.write(CALLS[:1]) + '\n<tool_call>\n{"name": "noop", "arguments": {}',
                             LLAMA3.write(CALLS[:1]) + '; {"name": "noop", "parameters": {',
                             '[TOOL_CALLS][{"name": "add", "arguments": {}}, {"name": "noop"'],
    "closer missing": ['<tool_call>\n{"name": "add", "arguments": {}}', '<tool_call>\n{"name": "add", "arguments": {}}'
                       '\n</tool_', '<tool_call>\n{"name": "add", "arguments": {}} junk </tool_call>'],
    "not a list": ['[TOOL_CALLS]{"name": "add", "arguments": {}}'] * 3,
    "an empty list": ["[TOOL_CALLS][]"] * 3,
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_replies_are_plain_text(case):
    hermes, llama3, mistral = MALFORMED[case]
    fmt_of = {"closer missing": HERMES, "not a list": MISTRAL, "an empty list": MISTRAL}
    if case in fmt_of:
        for text in (hermes, llama3, mistral):
            assert fmt_of[case].parse(text) is None, text
        return
    assert HERMES.parse(hermes) is None
    assert LLAMA3.parse(llama3) is None
    assert MISTRAL.parse(mistral) is None


def test_a_well_formed_call_is_read_where_its_malformed_variants_are_not():
    # The malformed cases above are refused for what they break, not for their shape: the same calls well formed
    # are read.
    assert HERMES.parse(HERMES.write(CALLS[:1]) + "\n") == Parsed(None, CALLS[:1])
    assert LLAMA3.parse(LLAMA3.write(CALLS[:1]) + "; " + LLAMA3.write(CALLS[2:3])) == Parsed(None, (CALLS[0], CALLS[2]))
    assert MISTRAL.parse(MISTRAL.write(CALLS[:1]) + "\n") == Parsed(None, CALLS[:1])


def test_a_clients_malformed_arguments_are_written_as_they_came():
    text = HERMES.write([Call("add", "{not json")])
    assert text == '<tool_call>\n{"name": "add", "arguments": "{not json"}\n</tool_call>'
    assert HERMES.parse(text) is None  # arguments that are a string are not a call


def test_the_call_schema_names_each_function_first_and_takes_its_parameters():
    add = Function("add", {"type": "object", "properties": {"a": {"type": "integer"}}})
    bare = Function("ping", {})
    one = LLAMA3.call_schema([add])
    assert list(one["properties"]) == ["name", "parameters"]
    assert one["properties"]["name"] == {"const": "add"} and one["properties"]["parameters"] == add.parameters
    assert one["required"] == ["name", "parameters"] and one["additionalProperties"] is False
    both = HERMES.call_schema([add, bare])
    assert [o["properties"]["name"]["const"] for o in both["anyOf"]] == ["add", "ping"]
    assert both["anyOf"][1]["properties"]["arguments"] == {"type": "object"}


def test_function_as_openai_tool():
    assert Function("f", {"type": "object"}).as_openai() == {
        "type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert Function("f", {}, "Does f.").as_openai()["function"]["description"] == "Does f."


@pytest.mark.parametrize("template,family", [
    (None, "hermes"),
    ("", "hermes"),
    ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", "hermes"),
    ("{% for tool in tools %}<tools>{{ tool | tojson }}</tools>{% endfor %}<tool_call>", "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("{{- '<|python_tag|>' + tool_call.name }}<|eot_id|>", "llama3"),
    ('{"name": ..., "parameters": ...}{% if x %}<|eom_id|>{% else %}<|eot_id|>{% endif %}', "llama3"),
    ("<|eom_id|> without the parameters key", "hermes"),
    ("<|python_tag|> and [TOOL_CALLS]", "mistral"),  # Mistral's marker is looked for first
])
def test_format_for_reads_the_template(template, family):
    assert format_for(template) is FORMATS[family]


@pytest.mark.parametrize("template,knows", [
    (None, False),
    ("", False),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
    ("{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}", True),
])
def test_template_knows_tools(template, knows):
    assert template_knows_tools(template) is knows


FENCED = '```json\n{\n  "name": "calculate",\n  "arguments": {\n    "expression": "17 * 23"\n  }\n}\n```'


def test_hermes_reads_a_reply_of_fenced_call_objects_as_calls():
    """Qwen2.5-Coder writes its calls as fenced JSON under auto: a reply of only such blocks is calls."""
    assert HERMES.parse(FENCED) == Parsed(None, (Call("calculate", '{"expression": "17 * 23"}'),))
    two = FENCED + "\n\n```json\n[" + '{"name": "search", "arguments": {"query": "x"}}' + "]\n```"
    assert [c.name for c in HERMES.parse(two).calls] == ["calculate", "search"]


@pytest.mark.parametrize("text", ["Here it is:\n" + FENCED, '```json\n{"a": 1}\n```', "```python\nprint(1)\n```",
                                  '```json\n{"name": "f", "arguments": 3}\n```', "```json\n{broken\n```"])
def test_fenced_json_that_is_not_only_calls_is_text(text):
    assert HERMES.parse(text) is None
    assert LLAMA3.parse(text) is None and MISTRAL.parse(text) is None
