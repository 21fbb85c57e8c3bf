"""Tokenizer: GGUF conversion, special tokens, chat templates, caching; parity with transformers on real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_gguf import CHAT_TEMPLATE, tiny_config, tokenizer_metadata, write_gguf

from specdecode.models import tokenizer as tokenizer_mod
from specdecode.models.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello world", " Hello  world ", "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n",
    "x=1234567890; y = 3.14159e-10", "  \t\n\n   leading and trailing   \n",
    "naïve café 日本語 Привет 🤖👍🏽",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "I'm can't we'll THEY'RE", "a\r\nb\rc",
    "    indented\n\t\ttabs", "<|endoftext|>", "a" * 50, "!!!???...", "#include <stdio.h>\nint main(){return 0;}",
]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def tiny(**kwargs) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(tokenizer_metadata(**kwargs))


def token(tok: Tokenizer, text: str) -> int:
    return tok.backend.token_to_id(text)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trip(text: str) -> None:
    tok = tiny()
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_merges_apply_in_order() -> None:
    tok = tiny()
    assert tok.encode(" the") == [token(tok, "Ġthe")]
    assert tok.encode("in") == [token(tok, "in")]


def test_special_and_user_defined_tokens_stay_whole() -> None:
    tok = tiny()
    ids = tok.encode("<|im_start|>x<tool_call><|im_end|>")
    assert ids == [token(tok, "<|im_start|>"), token(tok, "x"), token(tok, "<tool_call>"), token(tok, "<|im_end|>")]
    # Control tokens are special (skipped on decode), user-defined ones are ordinary text.
    assert tok.decode(ids) == "x<tool_call>"
    assert tok.vocab_size == len(tokenizer_metadata()["tokenizer.ggml.tokens"])


def test_eos_token_ids_include_end_of_turn() -> None:
    tok = tiny()
    assert tok.eos_token_id == token(tok, "<|endoftext|>")
    assert tok.eos_token_ids == {token(tok, "<|endoftext|>"), token(tok, "<|im_end|>")}
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|endoftext|>")


def test_eot_metadata_joins_stop_tokens() -> None:
    meta = {**tokenizer_metadata(), "tokenizer.ggml.eot_token_id": 100}
    assert 100 in Tokenizer.from_gguf_metadata(meta).eos_token_ids


def test_add_bos_only_when_asked() -> None:
    tok = tiny(add_bos=True)
    assert tok.encode("hi", add_special_tokens=True) == [tok.bos_token_id, *tok.encode("hi")]
    assert tiny().encode("hi", add_special_tokens=True) == tiny().encode("hi")


def test_smollm_splits_digits_individually() -> None:
    # The vocabulary has the merge "1 2": GPT-2 splitting applies it, SmolLM's digit splitting must not.
    assert tiny(pre="gpt2").encode("12") == [token(tiny(), "12")]
    smollm = tiny(pre="smollm")
    assert smollm.encode("12") == [token(smollm, "1"), token(smollm, "2")]
    assert smollm.encode("a 12") == [token(smollm, "a"), token(smollm, "Ġ"), token(smollm, "1"), token(smollm, "2")]


def test_qwen2_normalizes_to_nfc() -> None:
    tok = tiny(pre="qwen2")
    assert tok.encode("e\u0301") == tok.encode("\u00e9")


def test_unknown_pre_warns_and_falls_back() -> None:
    with pytest.warns(UserWarning, match="mystery"):
        tok = tiny(pre="mystery")
    assert tok.decode(tok.encode("some text 12")) == "some text 12"


@pytest.mark.parametrize("kind", ["bert", "t5", None])
def test_other_vocabulary_kinds_rejected(kind: str | None) -> None:
    meta = {**tokenizer_metadata(), "tokenizer.ggml.model": kind}
    with pytest.raises(ValueError, match=f"m.gguf: tokenizer.ggml.model={kind!r} is not supported"):
        Tokenizer.from_gguf_metadata(meta, source="m.gguf")


# ------------------------------------------------------------------------------------------------
# SentencePiece BPE ("llama") vocabularies, Gemma style.

# Plain pieces and scores. "bc" outranks "ab" though listed after it: merges follow scores, not ids.
SPM_PIECES = {"▁": -10.0, "a": -11.0, "b": -12.0, "c": -13.0, "e": -14.0, "h": -15.0, "t": -16.0,
              "ab": -3.0, "bc": -2.0, "▁t": -1.0, "he": -5.0, "▁the": -6.0, "▁a": -7.0}
SPM_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
SPM_USER_DEFINED = ["<b>", "\n"]


def spm_metadata(**overrides) -> dict:
    """GGUF ``tokenizer.*`` metadata of a small SentencePiece vocabulary: control, user-defined, byte, plain."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = SPM_CONTROL + SPM_USER_DEFINED + byte_tokens + list(SPM_PIECES)
    types = [3] * len(SPM_CONTROL) + [4] * len(SPM_USER_DEFINED) + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [-1000.0] * (len(SPM_CONTROL) + len(SPM_USER_DEFINED)) + [0.0] * 256 + list(SPM_PIECES.values())
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_space_prefix": False, **overrides}


def spm(**overrides) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(spm_metadata(**overrides))


def pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.backend.id_to_token(i) for i in tok.encode(text)]


def test_spm_merges_follow_scores() -> None:
    tok = spm()
    assert pieces(tok, "abc") == ["a", "bc"]  # "bc" (-2) beats "ab" (-3)
    assert pieces(tok, "ab") == ["ab"]
    assert pieces(tok, " the") == ["▁the"]  # "▁t", then "he", then "▁t" + "he"
    assert pieces(tok, "the a") == ["t", "he", "▁a"]
    assert tok.vocab_size == len(spm_metadata()["tokenizer.ggml.tokens"])


def test_spm_byte_fallback_round_trips() -> None:
    tok = spm()
    assert pieces(tok, "é日") == ["<0xC3>", "<0xA9>", "<0xE6>", "<0x97>", "<0xA5>"]
    assert tok.decode(tok.encode("aé日 b")) == "aé日 b"
    assert tok.decode(tok.encode("\U0010ffff")) == "\U0010ffff"


def test_spm_spaces() -> None:
    tok = spm()
    assert pieces(tok, "a  a ") == ["a", "▁", "▁a", "▁"]
    for text in ("a  a ", " the", "  ", ""):
        assert tok.decode(tok.encode(text)) == text
    # With add_space_prefix (llama.cpp's default when the key is absent) every run of plain text gets a
    # leading "▁", after special tokens too, and decoding drops the one at the start.
    meta = spm_metadata()
    del meta["tokenizer.ggml.add_space_prefix"]
    prefixed = Tokenizer.from_gguf_metadata(meta)
    assert pieces(prefixed, "a") == ["▁a"]
    assert pieces(prefixed, "<start_of_turn>a") == ["<start_of_turn>", "▁a"]
    assert prefixed.decode(prefixed.encode("a the")) == "a the"


def test_spm_special_and_user_defined_tokens_stay_whole() -> None:
    tok = spm()
    text = "<start_of_turn>ab<b>\n<end_of_turn>"
    assert pieces(tok, text) == ["<start_of_turn>", "ab", "<b>", "\n", "<end_of_turn>"]
    assert tok.decode(tok.encode(text)) == "ab<b>\n"  # control tokens are skipped, user-defined ones kept
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.eos_token_ids == {1, 5}  # <eos>, <end_of_turn>
    assert (tok.bos_token, tok.eos_token) == ("<bos>", "<eos>")


def test_spm_adds_bos_only_when_asked() -> None:
    with_bos = spm(**{"tokenizer.ggml.add_bos_token": True})
    assert with_bos.encode("ab", add_special_tokens=True) == [2, *spm().encode("ab")]
    assert spm().encode("ab", add_special_tokens=True) == spm().encode("ab")
    meta = spm_metadata()
    del meta["tokenizer.ggml.add_bos_token"]  # llama.cpp adds BOS to SentencePiece vocabularies by default
    assert Tokenizer.from_gguf_metadata(meta).encode("", add_special_tokens=True) == [2]


def test_spm_save_round_trip(tmp_path: Path) -> None:
    meta = spm_metadata()
    del meta["tokenizer.ggml.add_space_prefix"]  # the prefix-stripping decoder must survive too
    tok = Tokenizer.from_gguf_metadata(meta)
    tok.save(tmp_path)
    back = Tokenizer.from_hf_dir(tmp_path)
    for text in ("<start_of_turn>abc the<b>\né", "", "  a"):
        assert back.encode(text) == tok.encode(text)
        assert back.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert back.eos_token_ids == tok.eos_token_ids


def test_spm_without_scores_is_a_clear_error() -> None:
    meta = spm_metadata()
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(ValueError, match="m.gguf: .*tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata(meta, source="m.gguf")


def test_chat_template_renders_like_hf() -> None:
    tok = tiny()
    messages = [{"role": "user", "content": "hi"}]
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template(messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_chat_template_globals_and_errors() -> None:
    backend = tiny().backend
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
                "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}{{ extra }}")
    tok = Tokenizer(backend, bos_token_id=token(tiny(), "<|im_start|>"), eos_token_id=None, chat_template=template)
    out = tok.apply_chat_template([{"role": "user", "content": "<b>é</b>"}], extra="!")
    assert out == '<|im_start|>[{"role": "user", "content": "<b>é</b>"}]!'
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        tok.apply_chat_template([{"role": "system", "content": ""}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(backend, None, None).apply_chat_template([])


def test_template_sandbox_blocks_attribute_access() -> None:
    tok = Tokenizer(tiny().backend, None, None, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|not safely"):
        tok.apply_chat_template([])


def test_save_and_from_hf_dir_round_trip(tmp_path: Path) -> None:
    tok = tiny(pre="smollm")
    tok.save(tmp_path / "tok")
    back = Tokenizer.from_hf_dir(tmp_path / "tok")
    for text in TEXTS:
        assert back.encode(text) == tok.encode(text)
    assert (back.bos_token_id, back.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert back.eos_token_ids == tok.eos_token_ids
    assert back.chat_template == tok.chat_template


def test_from_hf_dir_reads_jinja_file_and_generation_config(tmp_path: Path) -> None:
    tiny().save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["specdecode_eos_token_ids"]
    config["eos_token"] = {"content": "<|im_end|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{{ 'T' }}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.apply_chat_template([]) == "T"
    assert tok.eos_token_id == token(tok, "<|im_end|>")
    assert {7, 8, tok.eos_token_id} <= tok.eos_token_ids


def test_from_hf_dir_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_from_gguf_caches_conversion(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_gguf(tmp_path / "m.gguf", tiny_config(), {})
    first = Tokenizer.from_gguf(path)
    cached = list((cache / "tokenizers").iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("m-")
    assert sorted(p.name for p in cached[0].iterdir()) == ["tokenizer.json", "tokenizer_config.json"]

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again despite the cache")

    with monkeypatch.context() as patch:
        patch.setattr(Tokenizer, "from_gguf_metadata", classmethod(no_conversion))
        second = Tokenizer.from_gguf(path)
    assert second.encode(TEXTS[6]) == first.encode(TEXTS[6])
    assert second.eos_token_ids == first.eos_token_ids and second.chat_template == first.chat_template
    # A changed file is a different cache entry.
    write_gguf(path, tiny_config(), {}, metadata={"tokenizer.ggml.pre": "smollm"})
    assert Tokenizer.from_gguf(path).encode("12") != first.encode("12")


def test_unwritable_cache_is_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPECDECODE_CACHE", str(blocker / "cache"))  # a path below a file cannot be created
    path = write_gguf(tmp_path / "m.gguf", tiny_config(), {})
    assert Tokenizer.from_gguf(path).encode("the") == tiny().encode("the")


def test_byte_alphabet_is_gpt2s() -> None:
    alphabet = tokenizer_mod._byte_alphabet()
    assert len(set(alphabet.values())) == 256
    assert alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ" and alphabet[ord("a")] == "a"


# ------------------------------------------------------------------------------------------------
# Real files, against transformers' own GGUF tokenizer conversion.

PARITY_TEXTS = TEXTS + ["1 2 3", "3.5 + 4 = 7.5", "ÄÖÜ ß é", "<tool_call>{\"a\": 1}</tool_call>",
                        "<|fim_prefix|>def f(<|fim_suffix|>)<|fim_middle|>", "\n\n\n", "   ", "end. "]
# transformers (5.x) builds "smollm" files with plain GPT-2 splitting; SmolLM2's own tokenizer.json (and
# llama.cpp) split every digit first. The two differ only where a space run or a numeric symbol touches a digit.
SMOLLM_DIGIT_CASES = {"1 2 3  4   5": [33, 216, 34, 216, 35, 256, 36, 333, 37]}


def assert_parity_with_transformers(path: Path, texts: list[str], chat: bool = True) -> Tokenizer:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = Tokenizer.from_gguf(path, cache=False)
    for text in texts:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write hello world in C"}]
    for conversation in (messages, messages[1:]) if chat else ():
        for gen in (True, False):
            assert ours.apply_chat_template(conversation, add_generation_prompt=gen) == ref.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=gen)
    assert ours.eos_token_id == ref.eos_token_id and ours.bos_token_id == ref.bos_token_id
    return ours


@pytest.mark.integration
def test_smollm2_matches_transformers(smollm2_path: Path) -> None:
    tok = assert_parity_with_transformers(smollm2_path, PARITY_TEXTS)
    for text, ids in SMOLLM_DIGIT_CASES.items():
        assert tok.encode(text) == ids
    assert tok.eos_token_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    assert (tok.bos_token, tok.eos_token, tok.vocab_size) == ("<|im_start|>", "<|im_end|>", 49152)


@pytest.mark.slow
@pytest.mark.integration
def test_qwen_05b_matches_transformers() -> None:
    from specdecode.models.fetch import fetch

    tok = assert_parity_with_transformers(fetch("qwen2.5-coder-0.5b-instruct"), PARITY_TEXTS)
    assert tok.eos_token_ids == {151643, 151645}  # <|endoftext|>, <|im_end|>
    assert tok.decode(tok.encode("<tool_call>x<|fim_pad|>")) == "<tool_call>x"


# Token ids from llama.cpp's llama-server /tokenize ("add_special": false) on gemma-3-270m-q4_k_m.gguf.
GEMMA_LLAMA_CPP_IDS = {
    "": [],
    "Hello world": [9259, 1902],
    " Hello  world ": [26352, 138, 12392, 236743],
    "x=1234567890; y = 3.14159e-10": [236781, 236784, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828,
                                      236819, 236771, 236793, 570, 578, 236743, 236800, 236761, 236770, 236812,
                                      236770, 236810, 236819, 236744, 236772, 236770, 236771],
    "naïve café 日本語 Привет 🤖👍🏽": [1789, 238527, 560, 33443, 33375, 238582, 15745, 8362, 236743, 246143, 240493,
                                    242713],
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n": [
        105, 2364, 107, 3689, 563, 236743, 236778, 236862, 236778, 236881, 106, 107, 105, 4368, 107],
    "  \t\n\n   leading and trailing   \n": [138, 255968, 108, 139, 26016, 532, 45330, 139, 107],
    "\U0010ffff\ue000 <b>bold</b>": [482, 381, 429, 429, 245863, 236743, 200, 15640, 209],  # byte fallback
    # transformers disagrees on these two (see test_gemma_3_matches_llama_cpp_and_transformers).
    "x" + " " * 40 + "y": [236781, 167, 145, 236762],
    "▁▁hi ▁x": [236743, 5631, 236743, 1123],
}


@pytest.mark.slow
@pytest.mark.integration
def test_gemma_3_matches_llama_cpp_and_transformers() -> None:
    from specdecode.models.fetch import fetch

    path = fetch("gemma-3-270m")
    tok = Tokenizer.from_gguf(path, cache=False)
    for text, ids in GEMMA_LLAMA_CPP_IDS.items():
        assert tok.encode(text) == ids, text
        assert tok.encode(text, add_special_tokens=True) == [2, *ids], text  # add_bos_token is set
    # transformers splits runs of 32+ spaces into 16-space tokens where llama.cpp (and SentencePiece) take the
    # longest, and reads a literal "▁" next to a space as a space run; elsewhere all three agree.
    agreed = [t for t in [*PARITY_TEXTS, *GEMMA_LLAMA_CPP_IDS] if " " * 32 not in t and "▁" not in t]
    assert_parity_with_transformers(path, agreed, chat=False)
    assert tok.chat_template is None and tok.eos_token_ids == {1, 106}  # <eos>, <end_of_turn>
    assert (tok.bos_token, tok.eos_token, tok.vocab_size) == ("<bos>", "<eos>", 262144)


def test_unsupported_template_syntax_and_unreadable_tokenizer_json_are_clear_errors(tmp_path):
    from tokenizers import Tokenizer as _Backend, models as _models

    from specdecode.models.tokenizer import ChatTemplateError, Tokenizer

    tok = Tokenizer(_Backend(_models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")), None, None,
                    chat_template="{% generation %}{{ messages[0]['content'] }}{% endgeneration %}")
    with pytest.raises(ChatTemplateError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    (tmp_path / "tokenizer.json").write_text('{"version": "9", "model": 42}')
    with pytest.raises(ValueError, match="cannot be read as a tokenizer"):
        Tokenizer.from_hf_dir(tmp_path)


def test_encode_prompt_puts_one_bos_first_where_the_model_asks_for_it() -> None:
    tok = tiny(add_bos=True)
    bos = tok.bos_token_id
    assert tok.encode_prompt("hi") == [bos, *tok.encode("hi")]
    assert tok.encode_prompt("<|im_start|>hi") == [bos, *tok.encode("hi")]  # a template that writes it: not twice
    assert tiny().encode_prompt("hi") == tiny().encode("hi")  # add_bos_token false: none


@pytest.mark.parametrize("kind", ["byte-level", "byte-level-in-a-sequence", "sentencepiece"])
def test_token_bytes_join_to_the_texts_utf8_where_tokens_split_a_character(kind: str) -> None:
    tok = spm() if kind == "sentencepiece" else tiny()
    if kind == "byte-level-in-a-sequence":  # as a tokenizer.json may wrap it
        from tokenizers import decoders

        tok.backend.decoder = decoders.Sequence([decoders.ByteLevel()])
        tok = Tokenizer(tok.backend, tok.bos_token_id, tok.eos_token_id)
    text = "aé日 b" if kind == "sentencepiece" else "naïve 日本語 🤖 the"
    ids = tok.encode(text)
    alone = [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert any("\ufffd" in a for a in alone)  # some token holds part of a character
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    end = tok.eos_token_id
    assert tok.token_bytes(end) == tok.backend.id_to_token(end).encode()  # an added token: its text


def test_token_bytes_keep_the_space_prefix_that_decoding_drops() -> None:
    meta = spm_metadata()
    del meta["tokenizer.ggml.add_space_prefix"]  # llama.cpp's default: a "▁" before the text
    tok = Tokenizer.from_gguf_metadata(meta)
    ids = tok.encode("the a")
    assert tok.decode(ids) == "the a" and b"".join(tok.token_bytes(i) for i in ids) == b" the a"
