"""A sequence's end rules and streamed text, without a model."""

from __future__ import annotations

import pytest

from specdecode.batch.sequence import Request, SequenceState, prompt_ids
from test_text import ByteTokenizer

EOS = 999


def _seq(max_new: int = 20, stop=()) -> SequenceState:
    return SequenceState(Request((1,), max_new_tokens=max_new, stop=tuple(stop), eos=frozenset({EOS})), ByteTokenizer())


def _ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_grouping_of_tokens_into_steps_does_not_change_the_outcome():
    stepwise, at_once = _seq(stop=["lo w"]), _seq(stop=["lo w"])
    for t in _ids("hello world"):
        if not stepwise.finished:
            stepwise.append([t])
    at_once.append(_ids("hello world"))
    assert stepwise.generated == at_once.generated == _ids("hello w")  # cut at the token completing the stop
    assert stepwise.finish_reason == at_once.finish_reason == "stop"
    assert at_once.text == "hel"


def test_eos_ends_and_is_kept_in_the_ids_but_not_the_text():
    seq = _seq()
    kept = seq.append([*_ids("ok"), EOS, *_ids("more")])
    assert kept == [*_ids("ok"), EOS] and seq.finish_reason == "eos" and seq.text == "ok"


def test_budget_ends_with_length():
    seq = _seq(max_new=3)
    assert seq.append(_ids("abcdef")) == _ids("abc") and seq.finish_reason == "length" and seq.remaining == 0


def test_streamed_text_holds_back_stop_prefixes_and_never_shows_the_stop_string():
    seq = _seq(stop=["STOP"])
    shown = []
    for t in _ids("go ST"):
        shown.append(seq.output(seq.append([t])).text)
    assert "".join(shown) == "go "  # "ST" may become "STOP"
    last = seq.output(seq.append(_ids("OP!")))
    assert last.finish_reason == "stop" and "".join(shown) + last.text == "go " == seq.text


def test_streamed_text_releases_a_held_prefix_that_did_not_become_a_stop():
    seq = _seq(max_new=6, stop=["STOP"])
    pieces = [seq.output(seq.append([t])).text for t in _ids("a STAR")]
    assert "".join(pieces) == "a STAR" and seq.finish_reason == "length"


def test_multibyte_characters_stream_whole():
    seq = _seq()
    pieces = [seq.output(seq.append([t])).text for t in _ids("né🙂")]
    assert "".join(pieces) == "né🙂" and all("\ufffd" not in p for p in pieces)


def test_cancel_keeps_an_earlier_finish_and_a_finished_sequence_takes_no_tokens():
    seq = _seq(max_new=1)
    seq.append([65])
    seq.finish("cancelled")
    assert seq.finish_reason == "length"
    with pytest.raises(RuntimeError, match="has finished"):
        seq.append([66])


@pytest.mark.parametrize("prompt, max_new, message", [
    ("", 4, "the prompt is empty"),
    ([], 4, r"the prompt is empty \(no tokens\)"),
    ([1, 500], 4, r"must be in 0..99"),
    ([1, 2], 0, "max_new_tokens must be >= 1"),
    ([1] * 10, 7, r"the prompt \(10 tokens\) plus max_new_tokens \(7\) exceeds the model's context length \(16"),
])
def test_prompt_ids_names_what_is_wrong(prompt, max_new, message):
    with pytest.raises(ValueError, match=message):
        prompt_ids(prompt, None, 100, 16, max_new)
