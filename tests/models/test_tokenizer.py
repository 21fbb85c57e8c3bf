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


def test_sentencepiece_vocabulary_rejected() -> None:
    meta = {**tokenizer_metadata(), "tokenizer.ggml.model": "llama"}
    with pytest.raises(ValueError, match="'llama'"):
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


def assert_parity_with_transformers(path: Path, texts: list[str]) -> Tokenizer:
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
    for conversation in (messages, messages[1:]):
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
