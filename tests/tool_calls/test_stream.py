"""tool_calls/stream.py: a reply streamed in pieces of any size reads as the whole reply parses (the same content,
each call's name once and in order, its argument fragments joined to its arguments), text that only looks like
the start of an opener comes out whole as content, a call's name comes out as soon as it is written and no fragment
holds the call object's closing brace."""

from __future__ import annotations

import json

import pytest

from specdecode.tool_calls.formats import HERMES, LLAMA3, MISTRAL, Call, CallFormat
from specdecode.tool_calls.stream import CallStream, Delta

CALLS = (Call("add", '{"a": 1, "b": 2}'),
         Call("get_weather", '{"city": "Zürich", "when": {"days": [1, 2], "at": {"h": 9}}, "tags": ["a}", "{b"]}'),
         Call("noop", "{}"))


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def stream(fmt: CallFormat, parts: list[str]) -> list[Delta]:
    reader = CallStream(fmt)
    out = [d for part in parts for d in reader.feed(part)]
    return out + reader.finish()


def read(deltas: list[Delta]) -> tuple[str, list[tuple[int, str]], dict[int, str]]:
    """The streamed content joined, the (index, name) deltas in order, and each call's argument fragments joined."""
    content = "".join(d.content for d in deltas if d.index < 0)
    names = [(d.index, d.name) for d in deltas if d.name is not None]
    arguments: dict[int, str] = {}
    for d in deltas:
        if d.index >= 0:
            arguments[d.index] = arguments.get(d.index, "") + d.arguments
    return content, names, arguments


def expected(fmt: CallFormat, text: str) -> tuple[str, list[tuple[int, str]], dict[int, str]]:
    parsed = fmt.parse(text)
    assert parsed is not None and parsed.calls
    return (parsed.content or "", [(i, c.name) for i, c in enumerate(parsed.calls)],
            {i: c.arguments for i, c in enumerate(parsed.calls)})


REPLIES = {
    "hermes": [HERMES.write(CALLS[:1]), HERMES.write(CALLS), "Let me check <that> for you.\n" + HERMES.write(CALLS),
               "a <tool_c b <tool_call\n" + HERMES.write(CALLS[1:])],
    "llama3": [LLAMA3.write(CALLS[:1]), LLAMA3.write(CALLS), "\n " + LLAMA3.write(CALLS[1:])],
    "mistral": [MISTRAL.write(CALLS[:1]), MISTRAL.write(CALLS)],
}
FORMATS = {"hermes": HERMES, "llama3": LLAMA3, "mistral": MISTRAL}
CASES = [(family, i) for family, replies in REPLIES.items() for i in range(len(replies))]


@pytest.mark.parametrize("family,reply", CASES)
def test_every_piece_size_reads_as_the_whole_reply_parses(family, reply):
    fmt, text = FORMATS[family], REPLIES[family][reply]
    want = expected(fmt, text)
    for size in range(1, len(text) + 1):
        deltas = stream(fmt, pieces(text, size))
        assert read(deltas) == want, f"pieces of {size}"
        assert all((d.name is None) or (d.arguments == "" and d.content == "") for d in deltas)


def test_uneven_pieces_read_as_the_whole_reply_parses():
    text = "Sure: " + HERMES.write(CALLS)
    want = expected(HERMES, text)
    for seed in range(40):
        cuts, at, step = [], 0, seed
        while at < len(text):
            step = (step * 7 + 3) % 13 + 1  # sizes 1..13, in an order that varies with the seed
            cuts.append(text[at:at + step])
            at += step
        assert read(stream(HERMES, cuts)) == want


def test_each_name_comes_once_before_its_own_fragments():
    deltas = stream(HERMES, list(HERMES.write(CALLS)))
    seen: set[int] = set()
    for d in deltas:
        assert d.index >= 0
        if d.name is not None:
            assert d.index not in seen and d.index == len(seen)
            seen.add(d.index)
        else:
            assert d.index in seen and d.index == max(seen)  # a fragment follows its call's name, calls in turn
    assert seen == {0, 1, 2}


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=lambda f: f.family)
@pytest.mark.parametrize("text", ["a <tool_c b", "a <tool_call", "<tool_call", "x <tool_call>", "[TOOL", "x < y",
                                  "hello {x}", "", "<", "a\n"])
def test_plain_text_comes_out_whole_as_content(fmt, text):
    assert fmt.parse(text) is None
    for size in (1, 2, 3, len(text) or 1):
        deltas = stream(fmt, pieces(text, size))
        assert read(deltas) == (text, [], {})


def test_a_partial_opener_is_held_back_until_it_is_known_not_to_be_one():
    reader = CallStream(HERMES)
    assert reader.feed("a <tool_c") == [Delta(content="a ")]
    assert reader.feed(" b") == [Delta(content="<tool_c b")]
    assert reader.feed(" <") == [Delta(content=" ")]
    assert reader.finish() == [Delta(content="<")]
    assert reader.calls == 0


def test_the_name_comes_out_before_the_call_is_closed():
    text = "Checking.\n" + HERMES.write(CALLS[1:2])
    upto = text.index('"arguments": ') + len('"arguments": ')
    reader = CallStream(HERMES)
    early = reader.feed(text[:upto])
    assert early == [Delta(content="Checking.\n"), Delta(index=0, name="get_weather")]
    assert reader.calls == 0  # named, not yet closed
    assert read(early + reader.feed(text[upto:]) + reader.finish()) == expected(HERMES, text)
    assert reader.calls == 1


def test_the_name_comes_out_as_soon_as_it_is_written_char_by_char():
    text = HERMES.write(CALLS[:2])
    reader = CallStream(HERMES)
    named_at = []
    for i, ch in enumerate(text):
        if any(d.name for d in reader.feed(ch)):
            named_at.append(i + 1)
    second = text.index("<tool_call>", 1)
    assert named_at == [text.index('"arguments": ') + len('"arguments":'),
                        text.index('"arguments": ', second) + len('"arguments":')]


def test_argument_fragments_never_hold_the_call_objects_closing_brace():
    text = HERMES.write(CALLS)
    final = {i: c.arguments for i, c in enumerate(CALLS)}
    reader = CallStream(HERMES)
    sent: dict[int, str] = {}
    for ch in text:
        for d in reader.feed(ch):
            if d.index >= 0 and d.name is None:
                sent[d.index] = sent.get(d.index, "") + d.arguments
                assert final[d.index].startswith(sent[d.index]), sent[d.index]  # never more than the arguments
    assert sent == final
    assert reader.finish() == []


def test_the_closing_braces_before_the_closer_are_told_apart():
    # The arguments' own "}" and the call object's "}" have both arrived; the closer has not.
    text = HERMES.write(CALLS[:1])
    reader = CallStream(HERMES)
    out = reader.feed(text[:text.index("\n</tool_call>")])
    assert read(out)[2] == {0: '{"a": 1, "b": 2}'}
    assert read(out + reader.feed("\n</tool_call>") + reader.finish())[2] == {0: '{"a": 1, "b": 2}'}


def test_a_call_written_compactly_streams_its_arguments_as_json_of_the_same_value():
    text = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":{"c":[2]}}}\n</tool_call>'
    parsed = HERMES.parse(text)
    for size in range(1, len(text) + 1):
        content, names, arguments = read(stream(HERMES, pieces(text, size)))
        assert (content, names) == ("", [(0, "add")])
        assert json.loads(arguments[0]) == json.loads(parsed.calls[0].arguments) == {"a": 1, "b": {"c": [2]}}


def test_whitespace_only_content_before_a_call_is_only_whitespace():
    # parse() reads it as no content (None); the stream passes it on as it came, never as anything else.
    text = "\n\n" + HERMES.write(CALLS[:1])
    assert HERMES.parse(text).content is None
    for size in (1, 3, len(text)):
        content, names, arguments = read(stream(HERMES, pieces(text, size)))
        assert content.strip() == "" and names == [(0, "add")] and arguments == {0: CALLS[0].arguments}


@pytest.mark.parametrize("fmt", [LLAMA3, MISTRAL], ids=lambda f: f.family)
def test_formats_read_whole_give_out_nothing_until_the_end(fmt):
    text = fmt.write(CALLS)
    reader = CallStream(fmt)
    assert [d for ch in text for d in reader.feed(ch)] == []
    assert read(reader.finish()) == expected(fmt, text)
    assert reader.calls == 3


def test_llama3_text_that_does_not_start_a_call_streams_at_once():
    reader = CallStream(LLAMA3)
    assert reader.feed("  ") == []  # may yet be a call
    assert reader.feed("The answer") == [Delta(content="  The answer")]
    assert reader.feed(" is {x}.") == [Delta(content=" is {x}.")]
    assert reader.finish() == []


def test_a_malformed_call_read_whole_is_content():
    text = '{"name": "add", "parameters": {"a": 1'
    assert read(stream(LLAMA3, pieces(text, 4))) == (text, [], {})
    text = '[TOOL_CALLS][{"name": "add"}, '
    assert read(stream(MISTRAL, pieces(text, 4))) == (text, [], {})


def test_mistral_content_before_the_calls_streams_as_the_whole_reply_parses():
    text = "Sure. " + MISTRAL.write(CALLS[:2])
    assert read(stream(MISTRAL, pieces(text, 5))) == expected(MISTRAL, text)


def test_a_reply_of_fenced_calls_is_held_and_read_whole_and_other_fences_stream_at_once():
    fenced = '```json\n{\n  "name": "calculate",\n  "arguments": {"expression": "6 * 7"}\n}\n```'
    stream, out = CallStream(HERMES), []
    for ch in fenced:
        out += stream.feed(ch)
    assert out == []  # held: it may be a call
    out = stream.finish()
    assert [(d.index, d.name) for d in out if d.name] == [(0, "calculate")]
    assert "".join(d.arguments for d in out) == '{"expression": "6 * 7"}' and stream.calls == 1
    code, stream, shown = "```python\nprint(1)\n```", CallStream(HERMES), []
    for i, ch in enumerate(code):
        shown += stream.feed(ch)
        if i == len("```p") - 1:
            assert "".join(d.content for d in shown) == "```p"  # not a JSON fence: out at once
    assert "".join(d.content for d in shown + stream.finish()) == code
