"""Incremental detokenization and stop strings (no model: a byte-level toy tokenizer)."""

from __future__ import annotations

import pytest

from specdecode.text import Detokenizer, find_stop, stream_safe_length


class ByteTokenizer:
    """Token i < 256 is byte i; decoding joins the bytes as UTF-8 with U+FFFD for incomplete characters,
    as byte-level BPE decoders do."""

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", ["plain ascii", "héllo wörld", "日本語のテキスト", "emoji 🙂 and 𝄞", "a\u0301b"])
def test_incremental_text_equals_a_full_decode(text):
    ids = list(text.encode("utf-8"))
    detok = Detokenizer(ByteTokenizer())
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == detok.text == text
    assert all("\ufffd" not in p for p in pieces)  # an incomplete character is held back, never shown


def test_incomplete_character_at_the_end_is_flushed_as_a_full_decode_shows_it():
    ids = list("ok 🙂".encode("utf-8"))[:-2]
    detok = Detokenizer(ByteTokenizer())
    assert "".join(detok.add(i) for i in ids) == "ok "
    assert detok.flush() == ByteTokenizer().decode(ids)[3:]
    assert detok.text == ByteTokenizer().decode(ids)


def test_skipped_ids_leave_no_text():
    detok = Detokenizer(ByteTokenizer(), skip={300})
    assert [detok.add(i) for i in (104, 300, 105)] == ["h", "", "i"]


def test_find_stop_reports_the_earliest_match_reaching_past_since():
    assert find_stop("abc STOP def", ["STOP"]) == 4
    assert find_stop("abc STOP def", ["def", "STOP"]) == 4
    assert find_stop("abc ST", ["STOP"]) is None
    assert find_stop("abc STOP", ["STOP"], since=6) == 4  # a match completed by the new characters
    assert find_stop("STOP and more", ["STOP"], since=13) is None  # searched already
    assert find_stop("anything", []) is None


def test_stream_safe_length_holds_back_a_possible_stop_prefix():
    assert stream_safe_length("hello wor", ["world"]) == 6
    assert stream_safe_length("hello", ["world"]) == 5
    assert stream_safe_length("hello w", ["world", "xyz"]) == 6
    assert stream_safe_length("abc", []) == 3
