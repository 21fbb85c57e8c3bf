"""One request at a time: a front end that runs each request as the only sequence of a batch engine.

The decode step (draft, one target forward, verify, roll back, commit) exists once, in
``batch/executor.py``; this module only gives it the single-request API: text in, a result or a stream of
text pieces out, with the KV slot sized to the longest request so far. It does not load models, parse
command lines or serve several requests at once (``BatchEngine`` does, behind ``specdecode serve``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, ContextManager, Iterable, Iterator, Sequence

from specdecode.batch.executor import BatchEngine
from specdecode.batch.observer import RecordObserver
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.batch.sequence import GenerationResult, Output, SequenceState
from specdecode.batch.stream import TextStream
from specdecode.control import StepRecord
from specdecode.control.config import SpeculativeConfig
from specdecode.drafters.base import Drafter
from specdecode.grammar import Grammar
from specdecode.kv.cache import Cache, CacheConfig
from specdecode.kv.memory import KVMemory
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams

FIRST_SLOT_LEN = 0  # tokens the KV slot holds before the first request grows it to its size

__all__ = ["Engine", "GenerationResult", "SpeculativeConfig", "TextStream"]


class Engine:
    """Serves one request at a time with speculative decoding.

    Args:
        target: the model whose output distribution is reproduced exactly.
        tokenizer: turns text into ids and back (needed for text prompts, stop strings and text output).
        drafter: proposes tokens; None means plain decoding.
        spec: gamma policy.
        on_step: called with every step's record (draft signals included), e.g. to gather training data
            for the ``confidence`` controller.
        cache: KV cache settings (dtype, window, sinks, budget, prefix cache); its size is set per request.
    """

    def __init__(self, target: Transformer, tokenizer=None, drafter: Drafter | None = None,
                 spec: SpeculativeConfig = SpeculativeConfig(),
                 on_step: Callable[[StepRecord], None] | None = None, cache: CacheConfig = CacheConfig()) -> None:
        spec = spec if drafter is not None else replace(spec, gamma=0)
        context = target.config.max_position_embeddings
        # One sequence: its fed token and its longest draft fit every forward; a prompt goes in one forward.
        scheduler = SchedulerConfig(max_running=1, max_waiting=0, max_rows=max(2, 1 + spec.max_draft),
                                    prefill_chunk=context)
        self.batch = BatchEngine(target, tokenizer, (lambda: drafter) if drafter is not None else None, spec, cache,
                                 scheduler, max_len=context, observer=RecordObserver(on_step) if on_step else None,
                                 slot_len=FIRST_SLOT_LEN, record_signals=on_step is not None)
        self.target, self.tokenizer, self.drafter, self.spec = target, tokenizer, drafter, self.batch.spec
        self._running: SequenceState | None = None

    @property
    def cache(self) -> Cache:
        """The target's KV cache (one slot)."""
        return self.batch.kv.cache

    @property
    def memory(self) -> KVMemory:
        """The KV budget over the target's and the drafter's caches and the prefix caches."""
        return self.batch.memory

    def warmup(self) -> None:
        """A dummy request, then the timings the controllers and the stats need (``BatchEngine.warmup``)."""
        self.batch.warmup()

    def verify_timer(self, context: Sequence[int]) -> ContextManager[Callable[[int], float]]:
        """``seconds(k)`` of verifying k drafted tokens after ``context`` (``BatchEngine.verify_timer``)."""
        return self.batch.verify_timer(context)

    def memory_bytes(self) -> dict[str, int]:
        """Target and draft weights, and their KV caches as allocated."""
        return self.batch.memory_bytes()

    def generate(self, prompt: str | Sequence[int], sampling: SamplingParams = SamplingParams(),
                 max_new_tokens: int = 128, stop: str | Iterable[str] = (),
                 eos_token_ids: Iterable[int] | None = None,
                 prediction: str | Sequence[int] | None = None, grammar: Grammar | None = None) -> GenerationResult:
        """Generates a continuation of ``prompt``; see :meth:`stream` for the arguments."""
        stream = self.stream(prompt, sampling, max_new_tokens, stop, eos_token_ids, prediction, grammar)
        for _ in stream:  # runs the request to its end
            pass
        return stream.result

    def stream(self, prompt: str | Sequence[int], sampling: SamplingParams = SamplingParams(),
               max_new_tokens: int = 128, stop: str | Iterable[str] = (),
               eos_token_ids: Iterable[int] | None = None,
               prediction: str | Sequence[int] | None = None, grammar: Grammar | None = None) -> TextStream:
        """Like :meth:`generate`, but yields text as it is accepted. The request is submitted at once, so bad
        input is refused here.

        Args:
            prompt: text (``Tokenizer.encode_prompt``: BOS first where the model wants one) or token ids.
            sampling: temperature / top-k / top-p / seed.
            max_new_tokens: generation budget (>= 1).
            stop: a string or strings that end generation: generation stops at the token that completes
                one (as plain decoding would), and the text is cut before it.
            eos_token_ids: ids that end generation; default: the tokenizer's end-of-sequence ids.
            prediction: text (or token ids) the output is expected to be mostly made of (e.g. the original of an
                edit): drafted wherever the output follows it, whatever the drafter; never changes the output.
            grammar: what the output must match (``grammar.Grammar``: a JSON schema, any JSON object, a regex, a
                choice): every token is drawn from the target's distribution masked by it, drafts included, and
                the request ends when it is complete; with speculation on, the tokens it forces are drafted.
        """
        if self._running is not None and not self._running.finished:  # a stream abandoned before its end
            self.batch.cancel(self._running)
        outputs: list[Output] = []
        seq = self._running = self.batch.submit(prompt, sampling, max_new_tokens, stop, eos_token_ids,
                                                on_output=lambda _, out: outputs.append(out), prediction=prediction,
                                                grammar=grammar)
        return TextStream(self._steps(seq, outputs))

    def _steps(self, seq: SequenceState, outputs: list[Output]) -> Iterator[Output]:
        try:
            while not seq.finished:
                self.batch.step()
                yield from outputs
                outputs.clear()
        except GeneratorExit:  # the stream was closed before its end: free the slot
            self.batch.cancel(seq)
            raise
        except BaseException:
            self.batch.cancel(seq, "error")
            raise
        return seq.result()
