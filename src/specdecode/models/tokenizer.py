"""Text <-> token ids, stop tokens and chat templates for a model, from a GGUF file or a HF folder.

Wraps a `tokenizers.Tokenizer` (the Rust tokenizer transformers uses) and renders HF-style Jinja chat
templates in a sandbox. A GGUF file carries its vocabulary but no ``tokenizer.json``; the tokenizer
it describes is rebuilt here and cached. Two GGUF vocabulary kinds (``tokenizer.ggml.model``) are
supported: byte-level BPE (``gpt2``: Llama 3, Qwen2, SmolLM, GPT-2 style) and SentencePiece BPE
(``llama``: Llama 2, Mistral, Gemma 3), the latter tokenizing as llama.cpp does. Unigram (``t5``),
WordPiece (``bert``) and other kinds are not supported, nor is incremental (streaming) detokenization.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from specdecode.models.fetch import cache_dir
from specdecode.models.gguf import read_gguf

# Bumped whenever the GGUF conversion changes, so stale cached tokenizers are rebuilt.
_CONVERTER_VERSION = 2

# Chat end-of-turn markers that also end generation when the vocabulary has them as special tokens.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_REGEX = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
                "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT}

# llama.cpp's token types (tokenizer.ggml.token_type) that become added tokens.
_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4

# SentencePiece's visible space: the vocabulary spells " the" as "▁the".
_SPM_SPACE = "\u2581"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback token


class ChatTemplateError(ValueError):
    """A chat template rejected its input (via ``raise_exception``) or the tokenizer has no template."""


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _has_byte_level(decoder: Mapping[str, Any]) -> bool:
    """Whether a decoder (its JSON form) maps byte-level BPE characters back to bytes, alone or in a sequence."""
    return decoder.get("type") == "ByteLevel" or any(_has_byte_level(d) for d in decoder.get("decoders") or [])


@lru_cache(maxsize=1)
def _byte_values() -> dict[str, int]:
    """The byte alphabet read backwards: printable character -> byte."""
    return {c: b for b, c in _byte_alphabet().items()}


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp's ``tokenizer.ggml.pre`` name stands for."""
    if pre == "smollm":
        # SmolLM's own tokenizer.json: every digit is its own word, then GPT-2 splitting.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _SPLIT_REGEX:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in ("gpt2", "default"):
        warnings.warn(f"GGUF tokenizer.ggml.pre={pre!r} is unknown here; using GPT-2 splitting, "
                      "which may tokenize differently from the original model", stacklevel=3)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _token_types(meta: Mapping[str, Any]) -> list[int]:
    """Each token's llama.cpp type; a file without ``token_type`` has only normal (1) tokens."""
    return meta.get("tokenizer.ggml.token_type") or [1] * len(meta["tokenizer.ggml.tokens"])


def _byte_level_backend(meta: Mapping[str, Any], source: str) -> tuple[_Backend, dict[str, int]]:
    """Byte-level BPE from the file's merges; returns the backend and its model vocabulary."""
    if "tokenizer.ggml.merges" not in meta:
        raise ValueError(f"{source}: GGUF metadata lacks tokenizer.ggml.merges")
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Real byte-level tokens are spelled in the byte alphabet; others (added tokens with spaces) are respelled.
    vocab = {tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8")): i
             for i, tok in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                  end_of_word_suffix="", fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in ("qwen2", "deepseek-r1-qwen"):
        backend.normalizer = normalizers.NFC()  # as Qwen2's own tokenizer.json
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _merges_by_score(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece BPE over ``tokens``.

    SentencePiece (and llama.cpp) repeatedly merges the adjacent pair whose joined text is the
    highest-scoring piece, so every split of a piece into two pieces is a merge ranked by that piece's
    score (ties by id; a piece's own splits shortest left part first, as transformers orders them).
    Control and user-defined tokens are left out: they are matched whole before the model sees the
    text, so no merge can produce or consume them.
    """
    ids = {tok: i for i, (tok, kind) in enumerate(zip(tokens, types, strict=True))
           if kind not in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)}
    ranked = sorted(ids.values(), key=lambda i: (-scores[i], i))
    return [(piece[:k], piece[k:]) for piece in (tokens[i] for i in ranked)
            for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]


def _sentencepiece_backend(meta: Mapping[str, Any], source: str) -> tuple[_Backend, dict[str, int]]:
    """SentencePiece BPE as llama.cpp runs it; returns the backend and its model vocabulary.

    Spaces become "▁" (plus one in front when ``add_space_prefix``), merges come from the scores, and
    characters outside the vocabulary fall back to the ``<0xNN>`` byte tokens.
    """
    if "tokenizer.ggml.scores" not in meta:
        raise ValueError(f"{source}: GGUF metadata lacks tokenizer.ggml.scores")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    merges = _merges_by_score(tokens, meta["tokenizer.ggml.scores"], _token_types(meta))
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, dropout=None, byte_fallback=True, fuse_unk=True,
                                  unk_token=None if unk is None else tokens[unk]))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)  # llama.cpp's default for this kind
    # No pre-tokenizer: SentencePiece merges across word boundaries within each run of plain text.
    backend.normalizer = normalizers.Sequence([*([normalizers.Prepend(_SPM_SPACE)] if prefix else []),
                                               normalizers.Replace(" ", _SPM_SPACE)])
    backend.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    return backend, vocab


# How each supported tokenizer.ggml.model is built.
_GGUF_BACKENDS = {"gpt2": _byte_level_backend, "llama": _sentencepiece_backend}


def _template_tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                     separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' tojson: unlike jinja2's own, it does not HTML-escape.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _template_tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or a dict with ``content``."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """A model's tokenizer: encode/decode, BOS/EOS ids, the set of stop tokens and the chat template.

    Args:
        backend: the underlying ``tokenizers.Tokenizer`` (it decides whether ``add_special_tokens``
            prepends BOS, through its post-processor).
        bos_token_id: beginning-of-sequence id, or None.
        eos_token_id: the model's end-of-sequence id, or None.
        eos_token_ids: every id that ends generation; ``eos_token_id`` and end-of-turn special tokens
            in END_OF_TURN_TOKENS are added to it.
        chat_template: HF Jinja chat template, or None.
    """

    def __init__(self, backend: _Backend, bos_token_id: int | None, eos_token_id: int | None,
                 eos_token_ids: Iterable[int] = (), chat_template: str | None = None) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        added = backend.get_added_tokens_decoder()
        special = {t.content for t in added.values() if t.special}
        stops = set(eos_token_ids) | {backend.token_to_id(t) for t in END_OF_TURN_TOKENS if t in special}
        if eos_token_id is not None:
            stops.add(eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(stops)
        self.chat_template = chat_template
        self._added = {i: t.content.encode() for i, t in added.items()}  # token_bytes of added tokens
        self._byte_level = _has_byte_level(json.loads(backend.decoder.__getstate__())) if backend.decoder else False

    @property
    def vocab_size(self) -> int:
        """Token ids this tokenizer can produce, added tokens included (may be below the model's vocab_size)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> list[str]:
        """Every token's text, indexed by id (what a draft and its target must agree on)."""
        by_id = {i: t for t, i in self.backend.get_vocab(with_added_tokens=True).items()}
        return [by_id.get(i, "") for i in range(max(by_id) + 1)]

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text, or None."""
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """The EOS token's text, or None."""
        return None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token markup such as ``<|im_start|>`` is always kept whole.

        Args:
            text: the text.
            add_special_tokens: let the tokenizer add BOS (or whatever its post-processor adds).
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt as the model expects one: BOS first where the tokenizer adds it (a GGUF's
        ``add_bos_token``; Gemma answers poorly without) and the text does not already start with it (a chat
        template that writes it)."""
        ids = self.encode(text, add_special_tokens=True)
        if len(ids) >= 2 and ids[0] == ids[1] == self.bos_token_id:
            return ids[1:]
        return ids

    def encode_with_ends(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids of ``text`` (no special tokens added) and where each token ends in it (characters)."""
        encoding = self.backend.encode(text, add_special_tokens=False)
        return encoding.ids, [end for _, end in encoding.offsets]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``.

        Args:
            ids: token ids.
            skip_special_tokens: drop special tokens such as ``<|im_end|>`` from the text.
        """
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for: a piece of a multi-byte character has its own bytes, where decoding
        the token alone shows U+FFFD (OpenAI's logprobs ``bytes``). A byte-level BPE token's characters map
        back through the byte alphabet; a SentencePiece byte token ``<0xNN>`` is that byte and its "▁" a space;
        an added token is its text."""
        piece = self.backend.id_to_token(token)
        if piece is None:
            return b""
        if token in self._added:
            return self._added[token]
        values = _byte_values()
        if self._byte_level and all(c in values for c in piece):
            return bytes(values[c] for c in piece)
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        return piece.replace(_SPM_SPACE, " ").encode()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Renders a conversation with the model's chat template, as transformers does.

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]``.
            add_generation_prompt: end with the header that starts the assistant's turn.
            **kwargs: extra template variables (``tools``, ``documents`` ...).

        Raises:
            ChatTemplateError: no template, the template called ``raise_exception``, or it failed on these
                messages (e.g. a ``None`` content where it adds strings).
        """
        if self.chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template; pass plain text instead")
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:  # syntax we do not support, or an error the template raised
            raise ChatTemplateError(f"chat template: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:  # messages it cannot take
            raise ChatTemplateError(f"the chat template cannot render these messages: {exc}") from exc

    # ------------------------------------------------------------------------------------------
    # Persistence: a folder with tokenizer.json + tokenizer_config.json, readable by from_hf_dir.

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` into folder ``path`` (created if needed).

        Args:
            path: destination folder; :meth:`from_hf_dir` reads it back.
        """
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config = {"bos_token": self.bos_token, "eos_token": self.eos_token, "chat_template": self.chat_template,
                  "specdecode_eos_token_ids": sorted(self.eos_token_ids)}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Loads ``tokenizer.json`` plus ``tokenizer_config.json`` (special tokens, chat template).

        ``chat_template.jinja`` overrides the config's template; ``generation_config.json``'s
        ``eos_token_id`` joins the stop tokens.

        Args:
            path: a HF model folder, or one written by :meth:`save`.

        Raises:
            FileNotFoundError: the folder has no tokenizer.json.
        """
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder}: no tokenizer.json "
                                    "(slow, sentencepiece-only tokenizers are not supported)")
        try:
            backend = _Backend.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # the tokenizers library raises a bare Exception for files it cannot parse
            raise ValueError(f"{folder / 'tokenizer.json'}: cannot be read as a tokenizer ({exc})") from exc
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        stops = list(config.get("specdecode_eos_token_ids", ()))
        generation_file = folder / "generation_config.json"
        if generation_file.is_file():
            eos = json.loads(generation_file.read_text()).get("eos_token_id")
            stops += eos if isinstance(eos, list) else [] if eos is None else [eos]

        def token_id(key: str) -> int | None:
            content = _token_content(config.get(key))
            return None if content is None else backend.token_to_id(content)

        return cls(backend, token_id("bos_token"), token_id("eos_token"), stops, template)

    # ------------------------------------------------------------------------------------------
    # GGUF

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], metadata: Mapping[str, Any] | None = None,
                  cache: bool = True) -> Tokenizer:
        """Builds the tokenizer a GGUF file describes, via a cache of converted tokenizers.

        Args:
            path: the ``.gguf`` file.
            metadata: its already-parsed metadata (saves re-reading the header), or None.
            cache: read/write the converted tokenizer under ``cache_dir()/tokenizers``, keyed by the
                file's absolute path, size and modification time.
        """
        path = Path(path)
        cached = _cache_folder(path) if cache else None
        if cached is not None and cached.is_dir():
            return cls.from_hf_dir(cached)
        if metadata is None:
            metadata = read_gguf(path).metadata
        tokenizer = cls.from_gguf_metadata(metadata, source=str(path))
        if cached is not None:
            _save_atomically(tokenizer, cached)
        return tokenizer

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str = "GGUF file") -> Tokenizer:
        """Builds the tokenizer from GGUF ``tokenizer.*`` metadata.

        Control tokens become special added tokens (kept whole, skipped by ``decode``); user-defined
        tokens become plain added tokens (kept whole, not skipped), as transformers does.

        Args:
            meta: GGUF metadata with ``tokenizer.ggml.model``, ``tokens``, ``token_type``, ``bos_token_id``,
                ``eos_token_id``; ``merges`` and ``pre`` for byte-level BPE, ``scores`` (and optionally
                ``unknown_token_id``, ``add_space_prefix``) for SentencePiece; optionally ``add_bos_token``,
                ``eot_token_id`` and ``tokenizer.chat_template``.
            source: named in error messages.

        Raises:
            ValueError: a vocabulary kind other than ``gpt2`` or ``llama``, or metadata it needs missing.
        """
        kind = meta.get("tokenizer.ggml.model")
        if kind not in _GGUF_BACKENDS:
            raise ValueError(f"{source}: tokenizer.ggml.model={kind!r} is not supported; only byte-level BPE "
                             "('gpt2') and SentencePiece BPE ('llama') are")
        if "tokenizer.ggml.tokens" not in meta:
            raise ValueError(f"{source}: GGUF metadata lacks tokenizer.ggml.tokens")
        backend, vocab = _GGUF_BACKENDS[kind](meta, source)
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        # Only tokens the model vocabulary spells as the file does: a byte-level control token spelled outside
        # the byte alphabet is a llama.cpp mislabel, and adding it would grow the vocab.
        typed = [(t, k) for i, (t, k) in enumerate(zip(tokens, _token_types(meta), strict=True)) if vocab.get(t) == i]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed
                                    if k == _TOKEN_TYPE_CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed
                            if k == _TOKEN_TYPE_USER_DEFINED])

        bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
            bos_text = tokens[bos]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_text} $A", pair=f"{bos_text} $A {bos_text} $B", special_tokens=[(bos_text, bos)])
        stops = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
        return cls(backend, bos, eos, stops, meta.get("tokenizer.chat_template"))


def _cache_folder(gguf_path: Path) -> Path:
    """Cache location of the converted tokenizer of a GGUF file; changes when the file does."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    key = hashlib.sha256(f"{resolved}:{stat.st_size}:{stat.st_mtime_ns}:{_CONVERTER_VERSION}".encode()).hexdigest()
    return cache_dir() / "tokenizers" / f"{resolved.stem}-{key[:16]}"


def _save_atomically(tokenizer: Tokenizer, folder: Path) -> None:
    """Writes the cache folder under a temporary name and renames it, so readers never see half of it."""
    tmp: Path | None = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        tokenizer.save(tmp)
        os.rename(tmp, folder)
    except OSError:
        pass  # another process won the race, or the cache is read-only: the cache is only an optimization
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
