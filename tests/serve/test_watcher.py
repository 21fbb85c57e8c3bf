"""A request whose engine never answers: the watcher beside it ends it (an error, not a hang) when the engine's
thread has stopped, and a deadline cancels a request at its time, not up to a second later."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from specdecode.batch.sequence import Request as EngineRequest, SequenceState
from specdecode.serve.app import ServedModel
from specdecode.serve.errors import APIError
from specdecode.serve.requests import CompletionRequest


_TARGET = SimpleNamespace(config=SimpleNamespace(vocab_size=100))  # what the server reads of the model


class _SilentLoop:
    """An engine loop that takes requests and never steps them; ``alive`` as the test sets it."""

    def __init__(self) -> None:
        self.alive, self.cancelled = True, []
        self.engine = type("Engine", (), {"tokenizer": None, "max_len": 64, "target": _TARGET})()

    def submit(self, on_output, **request) -> Future:
        future: Future = Future()
        future.set_result(SequenceState(EngineRequest(tuple(request["prompt"])), on_output=on_output))
        return future

    def cancel(self, seq) -> None:
        self.cancelled.append(seq)


def _request() -> Request:
    async def receive() -> dict:
        await asyncio.sleep(3600)  # the client stays connected
        return {"type": "http.disconnect"}
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive)


def _answer(served: ServedModel, stop_engine_after: float | None) -> tuple[APIError, float]:
    async def go() -> APIError:
        body = CompletionRequest(model="m", prompt=[1, 2], max_tokens=4)
        if stop_engine_after is not None:
            asyncio.get_running_loop().call_later(stop_engine_after, setattr, served.loop, "alive", False)
        with pytest.raises(APIError) as err:
            await asyncio.wait_for(served.respond(_request(), body, [1, 2], chat=False), 10)  # fails, not hangs
        return err.value
    start = time.monotonic()
    error = asyncio.run(go())
    return error, time.monotonic() - start


def test_a_request_whose_engine_stopped_ends_with_an_error():
    served = ServedModel(_SilentLoop(), "m", None)
    error, seconds = _answer(served, stop_engine_after=0.1)
    assert error.status == 500 and "the engine stopped" in error.message and seconds < 3


def test_a_deadline_cancels_at_its_time_and_is_a_504_if_the_engine_confirms_nothing_else():
    loop = _SilentLoop()
    served = ServedModel(loop, "m", None, timeout_s=0.3)

    def confirm(seq) -> None:  # the engine's answer to a cancel: the sequence's last output
        loop.cancelled.append((seq, time.monotonic()))
        seq.finish_reason = "cancelled"
        seq.on_output(seq, seq.output([]))
    loop.cancel = confirm
    error, seconds = _answer(served, stop_engine_after=None)
    assert error.status == 504 and "deadline" in error.message
    assert 0.3 <= seconds < 0.9  # not the watcher's 1 s poll


def test_a_stream_whose_engine_stopped_ends_with_an_error_event_and_no_usage():
    served = ServedModel(_SilentLoop(), "m", None)

    async def go() -> list[str]:
        body = CompletionRequest(model="m", prompt=[1, 2], max_tokens=4, stream=True,
                                 stream_options={"include_usage": True})
        asyncio.get_running_loop().call_later(0.1, setattr, served.loop, "alive", False)
        response = await served.respond(_request(), body, [1, 2], chat=False)
        return [chunk async for chunk in response.body_iterator]
    events = asyncio.run(asyncio.wait_for(go(), 10))
    assert len(events) == 2 and "the engine stopped" in events[0] and events[1] == "data: [DONE]\n\n"

