"""Grammar-constrained decoding: a request's grammar (a JSON schema, any JSON object, a regex, a choice) compiled
by llguidance, and the per-request state the engine masks verified rows with, drafts forced tokens from and
advances by the accepted tokens.

A :class:`Constraint` follows one request: ``masks`` gives the allowed tokens at each row of a step's forward
(the fed token's row, then one per drafted token, down a tree's paths), ``forced`` the tokens the grammar
leaves no choice about, ``advance`` consumes the tokens a step kept. ``mask_rows`` applies masks to logits in
place, so that greedy picks, sampling, acceptance and log-probabilities all see the constrained distribution.

Not here: acceptance (``verify.py`` runs on the masked logits unchanged), where drafts are cut
(``drafters/forced.py``'s ``within``: a one-hot draft before its first refused token, a sampled one just after
it) or the HTTP fields (``serve/structured.py``).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

import llguidance

# Compact, one-line JSON with the usual separators: no free whitespace, which a small model may repeat until its
# budget runs out, and more of the text forced (free drafts).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPILED_KEPT = 256  # compiled grammars kept for reuse (most recently used)


class GrammarError(ValueError):
    """A grammar that cannot be compiled (a bad schema, regex or choice), named."""


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match.

    Args:
        source: the grammar in llguidance's form (JSON text).
        kind: what it was made from ("json_schema", "json_object", "regex" or "choice"), for messages.
    """

    source: str
    kind: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, strict: bool = True) -> Grammar:
        """Output that is JSON valid under ``schema``. ``strict``: a keyword llguidance cannot enforce is an error
        (else it is ignored, as OpenAI does for non-strict schemas)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        options = {**JSON_OPTIONS, "lenient": not strict}
        with _refused("json schema"):
            return cls(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options), "json_schema")

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's ``json_object`` response format)."""
        return replace(cls.json_schema({"type": "object"}), kind="json_object")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Output that matches ``pattern`` whole."""
        if not pattern:
            raise GrammarError("the regex is empty")
        with _refused("regex"):
            return cls(llguidance.LLMatcher.grammar_from_regex(pattern), "regex")

    @classmethod
    def choice(cls, options: Sequence[str]) -> Grammar:
        """Output that is exactly one of ``options``."""
        if not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError("a choice needs one or more non-empty strings")
        lark = "start: " + " | ".join(json.dumps(o) for o in options)
        with _refused("choice"):
            return cls(llguidance.LLMatcher.grammar_from_lark(lark), "choice")


@contextmanager
def _refused(what: str) -> Iterator[None]:
    """llguidance's own refusals of its input (text that is not Unicode, a value it cannot serialize) as a
    GrammarError naming ``what``."""
    try:
        yield
    except (ValueError, UnicodeError) as exc:
        raise GrammarError(f"the {what} cannot be compiled: {exc}") from None


class GrammarCompiler:
    """Compiles grammars for one tokenizer and keeps the compiled ones (COMPILED_KEPT, most recently used). Any
    thread may compile (the server compiles a request's grammar before the engine's thread takes the request).

    Args:
        tokenizer_json: the tokenizer in ``tokenizers``' JSON form (``Tokenizer.backend.to_str()``).
        vocab_size: the model's logit columns (ids past the tokenizer's are never allowed).
        eos_ids: the tokens that end a request whose grammar is complete.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        try:
            self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        except Exception as exc:  # llguidance's reasons, as they come (a tokenizer kind it does not read)
            raise GrammarError(f"this model's tokenizer cannot be used with a grammar ({exc})") from None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # guards _compiled; compiling runs outside it

    def compile(self, grammar: Grammar) -> llguidance.LLMatcher:
        """A fresh matcher for ``grammar``, at its start.

        Raises:
            GrammarError: the grammar does not compile (llguidance's message).
        """
        with self._lock:
            template = self._compiled.get(grammar.source)
        if template is None:
            with _refused(grammar.kind.replace("_", " ")):
                template = llguidance.LLMatcher(self._tokenizer, grammar.source, log_level=0)
            if template.is_error():
                raise GrammarError(f"the {grammar.kind.replace('_', ' ')} does not compile: {template.get_error()}")
        with self._lock:
            self._compiled[grammar.source] = template
            self._compiled.move_to_end(grammar.source)
            if len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return template.deep_copy()

    def special_id(self, text: str) -> int | None:
        """The id of ``text`` where it is one token that grammars must name (``<[id]>`` in lark) rather than spell:
        llguidance takes every added token (Qwen's ``<tool_call>``, ...) for a special one; else None."""
        ids = self._tokenizer.tokenize_str(text)
        return ids[0] if len(ids) == 1 and self._tokenizer.is_special_token(ids[0]) else None

    def start(self, grammar: Grammar) -> Constraint:
        return Constraint(self.compile(grammar), self.vocab_size)


class Constraint:
    """One request's place in its grammar.

    Args:
        matcher: an llguidance matcher at the request's start.
        vocab_size: logit columns.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._words = (vocab_size + 31) // 32

    @property
    def done(self) -> bool:
        """The grammar is complete and takes no further token (but an end-of-sequence one)."""
        return self._matcher.is_stopped()

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (none that a longer token could replace at the forced text's end)."""
        return self._matcher.compute_ff_tokens()

    def valid(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (from the current place) the grammar allows in a row."""
        return self._matcher.validate_tokens(list(tokens)) if tokens else 0

    def until_done(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (allowed ones) go up to and including the one that completes the grammar; all of
        them if none does."""
        consumed = self._consume(tokens)
        done = self._matcher.is_stopped()
        self._rollback(consumed)
        return consumed if done else len(tokens)

    def advance(self, tokens: Sequence[int]) -> None:
        """Consumes a step's kept tokens (each allowed: they were drawn from masked rows)."""
        if tokens and not self._matcher.consume_tokens(list(tokens)):
            raise RuntimeError(f"the grammar refused a kept token: {self._matcher.get_error()}")

    def masks(self, tokens: Sequence[int], parents: Sequence[int] | None = None) -> np.ndarray:
        """Allowed tokens at each row a step verifies ``tokens`` with: ``[1 + len(tokens), words]`` int32 bitmasks
        (bit t of row r set when token t may follow the row's path). Row 0 is the current place, row 1 + i the place
        after token i's path (its ancestors, then itself; a chain when ``parents`` is None). A row past a token the
        grammar refuses, or past the end of a complete grammar, is never reached (that token is never accepted, and a
        request ends where its grammar completes): it gets its parent's mask, so that no row is empty."""
        rows = np.zeros((1 + len(tokens), self._words), dtype=np.int32)
        self._fill(rows, 0)
        if parents is None:  # a chain: one pass down it
            consumed = 0
            for token in tokens[:self.valid(tokens)]:
                if self._consume([token]) == 0:  # the grammar is complete
                    break
                consumed += 1
                self._fill(rows, consumed)
            self._rollback(consumed)
            rows[1 + consumed:] = rows[consumed]
            return rows
        for node in range(len(tokens)):
            path = _path(parents, tokens, node)
            if self._matcher.validate_tokens(path) == len(path):
                consumed = self._consume(path)
                self._fill(rows, 1 + node)
                self._rollback(consumed)
            else:
                rows[1 + node] = rows[1 + parents[node]]
        return rows

    def _consume(self, tokens: Sequence[int]) -> int:
        """Consumes allowed ``tokens`` one by one until the grammar is complete (a matcher that has stopped takes an
        end-of-sequence token without counting it, so none is given to it); returns how many it took."""
        for n, token in enumerate(tokens):
            if self._matcher.is_stopped():
                return n
            if not self._matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")
        return len(tokens)

    def _rollback(self, n: int) -> None:
        if n and not self._matcher.rollback(n):
            raise RuntimeError(f"the grammar could not roll back {n} tokens: {self._matcher.get_error()}")

    def _fill(self, rows: np.ndarray, row: int) -> None:
        view = rows[row]
        self._matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)


def _path(parents: Sequence[int], tokens: Sequence[int], node: int) -> list[int]:
    """Tokens from the root down to ``node``, itself included."""
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def allowed(masks: np.ndarray, vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` bool from ``[rows, words]`` int32 bitmasks (bit t of a row: token t allowed)."""
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.view(np.bool_))


def sole_tokens(masks: np.ndarray) -> dict[int, int]:
    """{row: token} for the rows of ``[rows, words]`` int32 bitmasks that allow exactly one token: one word set, to a
    power of two (the bits are never unpacked: this runs every step)."""
    words = masks.view(np.uint32)
    sole = {}
    for row in np.flatnonzero(np.count_nonzero(words, axis=1) == 1):
        word = int(np.flatnonzero(words[row])[0])
        bits = int(words[row, word])
        if bits & (bits - 1) == 0:
            sole[int(row)] = 32 * word + bits.bit_length() - 1
    return sole


def mask_rows(logits: torch.Tensor, start: int, masks: np.ndarray) -> None:
    """Sets ``logits[start:start + len(masks)]`` ([rows, V], float) to -inf wherever ``masks`` disallow a token."""
    rows = logits[start:start + len(masks)]
    rows.masked_fill_(~allowed(masks, logits.shape[-1]).to(logits.device), float("-inf"))
