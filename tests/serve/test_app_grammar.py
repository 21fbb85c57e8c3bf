"""A request's grammar is compiled before the engine's thread takes the request, on a worker thread (not the
event loop's, not the engine's), so that a large schema holds up neither; one that does not compile is a 400
naming its field, and the engine never sees the request."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from types import SimpleNamespace

from specdecode.batch.sequence import Request as EngineRequest, SequenceState
from specdecode.grammar import GrammarError
from specdecode.serve.app import ServedModel
from specdecode.serve.errors import APIError
from specdecode.serve.requests import CompletionRequest
from specdecode.serve.metrics import ServeMetrics


_TARGET = SimpleNamespace(config=SimpleNamespace(vocab_size=100))  # what the server reads of the model


class _Compiler:
    def __init__(self, refuse: bool) -> None:
        self.refuse, self.threads = refuse, []

    def compile(self, grammar) -> None:
        self.threads.append(threading.current_thread())
        if self.refuse:
            raise GrammarError("the json schema does not compile: too deep")


class _Loop:
    """Takes requests without stepping them; records what the compiler had done when each arrived."""

    def __init__(self, compiler: _Compiler) -> None:
        self.alive, self.compiled_before_submit = True, []
        self.engine = type("Engine", (), {"tokenizer": None, "max_len": 64, "target": _TARGET, "grammar_compiler": lambda _: compiler})()
        self._compiler = compiler

    def submit(self, on_output, **request) -> Future:
        self.compiled_before_submit.append(len(self._compiler.threads))
        future: Future = Future()
        future.set_result(SequenceState(EngineRequest(tuple(request["prompt"])), on_output=on_output))
        return future


def _start(refuse: bool) -> tuple[_Loop, _Compiler, APIError | None]:
    compiler = _Compiler(refuse)
    loop = _Loop(compiler)
    served = ServedModel(loop, "m", ServeMetrics("m"))
    body = CompletionRequest(model="m", prompt=[1, 2], max_tokens=4, response_format={"type": "json_object"})

    async def go() -> APIError | None:
        try:
            await served.start([1, 2], body)
        except APIError as exc:
            return exc
        return None
    return loop, compiler, asyncio.run(go())  # the event loop runs on this (the main) thread


def test_a_grammar_is_compiled_on_a_worker_thread_before_the_engine_takes_the_request():
    loop, compiler, error = _start(refuse=False)
    assert error is None
    assert loop.compiled_before_submit == [1]
    assert compiler.threads[0] is not threading.main_thread()


def test_a_grammar_that_does_not_compile_is_a_400_naming_its_field_and_never_reaches_the_engine():
    loop, _, error = _start(refuse=True)
    assert error is not None and error.status == 400 and error.param == "response_format"
    assert "too deep" in error.message
    assert loop.compiled_before_submit == []
