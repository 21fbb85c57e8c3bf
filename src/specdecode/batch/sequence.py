"""One request's state while it is served: its tokens, text, stop rules, slot, controller, drafter and stats.

A :class:`SequenceState` is what the scheduler queues and the executor steps. :meth:`SequenceState.append` takes a
step's verified tokens and applies the end rules exactly where plain decoding would stop (an
end-of-sequence id, the token that completes a stop string, the token budget), so that a request's
tokens do not depend on how they were grouped into steps.

It does not run models, draft or verify (``executor.py``), nor decide when it runs (``scheduler.py``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from specdecode.control import GammaController
from specdecode.drafters.chain import DrafterChain
from specdecode.drafters.prediction import Prediction
from specdecode.grammar import Constraint, Grammar
from specdecode.logprobs import TokenLogprob
from specdecode.sampling import SamplingParams
from specdecode.stats import RequestStats
from specdecode.text import Detokenizer, find_stop, stream_safe_length

FINISH_REASONS = ("eos", "stop", "length", "cancelled", "error")
MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's chat limit)
_ids = itertools.count()


@dataclass(frozen=True)
class Request:
    """What a client asked for, checked (see ``prompts.encode_request``).

    Args:
        prompt_ids: the prompt's token ids (non-empty, in the vocabulary).
        sampling: temperature / top-k / top-p / seed.
        max_new_tokens: generation budget (>= 1).
        stop: strings that end generation (the text is cut before them).
        eos: ids that end generation (kept in ``token_ids``, left out of the text).
        prediction: text the output is expected to be mostly made of, drafted where the output follows it
            (``drafters/prediction.py``); None = no prediction.
        logprobs: report each token's log-probability with this many alternatives (0..MAX_TOP_LOGPROBS);
            None = none (``logprobs.py``).
        grammar: what the output must match (``grammar.py``); None = anything. The request ends when the
            grammar is complete.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    eos: frozenset[int] = frozenset()
    prediction: Prediction | None = None
    logprobs: int | None = None
    grammar: Grammar | None = None


@dataclass
class GenerationResult:
    """One finished request.

    Args:
        text: the generated text (stop string and end-of-sequence token excluded).
        token_ids: generated token ids, up to and including the token that ended generation (an
            end-of-sequence token or the token completing a stop string): the same with or without
            speculation.
        finish_reason: "eos", "stop" (a stop string), "length" (max_new_tokens), "cancelled" or "error".
        stats: counters and timings.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats = field(default_factory=RequestStats)


@dataclass
class Output:
    """What one step produced for one sequence.

    Args:
        token_ids: tokens appended this step.
        text: text that may be shown now (held back while it could still become a stop string).
        finish_reason: set on the sequence's last output (one of FINISH_REASONS).
        logprobs: each of ``token_ids``' log-probability, when the request asked for them.
    """

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(eq=False)
class SequenceState:
    """A request being served. Created by the executor's ``submit``; read-only for everyone else.

    Args:
        request: the checked request.
        tokenizer: decodes the text (None: token ids only).
        on_output: called with every :class:`Output` (from the thread that steps the executor).
    """

    request: Request
    tokenizer: object | None = None
    on_output: Callable[["SequenceState", Output], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    slot: int | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # what failed, when finish_reason is "error"
    stats: RequestStats = field(default_factory=RequestStats)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    # Set by the executor when the sequence starts running.
    controller: GammaController | None = None
    drafter: DrafterChain | None = None  # its drafter chain (drafters/chain.py); None: plain decoding
    generator: torch.Generator | None = None
    constraint: Constraint | None = None  # its place in its grammar, when it has one
    seed: int = 0
    prefilled: int = 0  # prompt tokens (all but the last) whose K/V the cache holds
    last_rows: int = 1  # rows it had in its last decode forward (fed token + drafts)

    def __post_init__(self) -> None:
        self.tokens: list[int] = list(self.request.prompt_ids)
        self.detokenizer = Detokenizer(self.tokenizer, self.request.eos)
        self._shown = 0  # characters of text already handed out
        self.stats.prompt_tokens = len(self.tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_pending(self) -> int:
        """Prompt tokens (all but the last, which the first decode step feeds) still to prefill."""
        return len(self.request.prompt_ids) - 1 - self.prefilled

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.generated)

    @property
    def text(self) -> str:
        """The final text (stop string and end-of-sequence tokens excluded); the text so far while running."""
        text = self.detokenizer.text
        cut = find_stop(text, self.request.stop)
        return text if cut is None else text[:cut]

    def append(self, tokens: Iterable[int]) -> list[int]:
        """Adds a step's tokens up to the first that ends generation; returns those kept.

        Ends with "eos" at an end-of-sequence id, "stop" at the token that completes a stop string,
        "length" when the budget is spent.
        """
        if self.finished:
            raise RuntimeError(f"sequence {self.id} has finished ({self.finish_reason}); it takes no more tokens")
        kept = []
        for token in tokens:
            if self.remaining <= 0:
                break
            kept.append(token)
            self.generated.append(token)
            self.tokens.append(token)
            before = len(self.detokenizer.text)
            new = self.detokenizer.add(token)
            if token in self.request.eos:
                self.finish_reason = "eos"
            elif new and find_stop(self.detokenizer.text, self.request.stop, before) is not None:
                self.finish_reason = "stop"
            elif self.remaining == 0:
                self.finish_reason = "length"
            if self.finished:
                break
        if kept and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        return kept

    def result(self) -> GenerationResult:
        """The request as ``Engine.generate`` returns it (meant for a finished sequence)."""
        return GenerationResult(self.text, list(self.generated), self.finish_reason, self.stats)

    def finish(self, reason: str) -> None:
        """Ends the sequence early ("cancelled" or "error") unless it already ended."""
        if self.finish_reason is None:
            self.finish_reason = reason

    def complete(self) -> None:
        """Ends the sequence as complete ("stop"): its grammar is, even where that token also spent the budget
        (its answer is whole, not cut); an end-of-sequence token or a stop string keeps its reason."""
        if self.finish_reason in (None, "length"):
            self.finish_reason = "stop"

    def output(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> Output:
        """The :class:`Output` of a step that appended ``tokens`` (with their ``logprobs``, if asked): the newly
        showable text."""
        if self.finished:
            self.detokenizer.flush()
            visible = len(self.text)
        else:
            visible = stream_safe_length(self.detokenizer.text, self.request.stop)
        text = self.text[self._shown:visible] if self.finished else self.detokenizer.text[self._shown:visible]
        self._shown = max(self._shown, visible)
        return Output(tokens, text, self.finish_reason, logprobs)

    def emit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Hands the :class:`Output` of a step that appended ``tokens`` to ``on_output``, if any."""
        if self.on_output is not None:
            self.on_output(self, self.output(tokens, logprobs))


def stop_strings(stop: str | Iterable[str], tokenizer) -> tuple[str, ...]:
    """A single stop string (not its characters) or several, checked: non-empty, and a tokenizer to see them."""
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if stop and tokenizer is None:
        raise ValueError("stop strings need an engine with a tokenizer")
    if any(not s for s in stop):
        raise ValueError("stop strings must not be empty")
    return stop


def predicted(prediction: str | Sequence[int] | None, tokenizer, vocab_size: int) -> Prediction | None:
    """A request's prediction, tokenized (text) or checked (token ids, as for prompts); None for none or an
    empty one (nothing to draft from).

    Raises:
        ValueError: text without a tokenizer, or ids outside the vocabulary.
    """
    if prediction is None or len(prediction) == 0:
        return None
    if isinstance(prediction, str):
        if tokenizer is None:
            raise ValueError("a text prediction needs an engine with a tokenizer")
        return Prediction.of(prediction, tokenizer)
    ids = tuple(int(t) for t in prediction)
    if any(not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prediction token ids must be in 0..{vocab_size - 1}")
    return Prediction("", ids, tuple(range(1, len(ids) + 1)))  # no text: a token's "end" is its index + 1


def eos_ids(eos_token_ids: Iterable[int] | None, tokenizer) -> frozenset[int]:
    """The ids that end generation: those given, else the tokenizer's end-of-sequence ids (none without one)."""
    if eos_token_ids is None:
        eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else ()
    return frozenset(eos_token_ids)


def prompt_ids(prompt: str | Sequence[int], tokenizer, vocab_size: int, context: int, max_new_tokens: int,
               context_name: str = "the model's context length") -> list[int]:
    """The prompt's token ids, checked: non-empty, in the vocabulary, and with room for ``max_new_tokens``.

    Args:
        prompt: text (``Tokenizer.encode_prompt``: BOS first where the model wants one) or token ids.
        tokenizer: needed for a text prompt.
        vocab_size: ids must be below it.
        context: the model's context length (prompt + new tokens must fit).
        max_new_tokens: the generation budget (>= 1).
        context_name: what ``context`` is, for the error message.

    Raises:
        ValueError: naming what is wrong.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        if tokenizer is None:
            raise ValueError("a text prompt needs an engine with a tokenizer")
        ids = tokenizer.encode_prompt(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty (no tokens)")
    if any(not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be in 0..{vocab_size - 1}")
    if len(ids) + max_new_tokens > context:
        raise ValueError(f"the prompt ({len(ids)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
                         f"{context_name} ({context} tokens)")
    return ids
