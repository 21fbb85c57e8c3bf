"""The ingress's answer logic with a fake replica handle (no cluster): held-back streams, retries while
nothing was sent, the SSE error after the first token, and errors that are not retried."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")

from ray.exceptions import ActorDiedError, ActorUnavailableError  # noqa: E402

from specdecode.serve.forward import ForwardedRequest, ResponseHead  # noqa: E402
from specdecode.serve.ray_app import _began, answer  # noqa: E402

HEAD = ResponseHead(200, [(b"content-type", b"text/event-stream"), (b"content-length", b"99")])
ROLE = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}\n\n'


def _event(text: str) -> bytes:
    return f'data: {json.dumps({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})}\n\n'.encode()


class FakeStream:
    """A replica's answer: ``items``, then ``fail`` raised where the items run out (if given)."""

    def __init__(self, items, fail: Exception | None = None) -> None:
        self.items, self.fail, self.cancelled = list(items), fail, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.fail is not None:
            raise self.fail
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    def __init__(self, *streams: FakeStream) -> None:
        self.streams, self.calls = list(streams), 0

    def remote(self, request):
        self.calls += 1
        return self.streams.pop(0)


def _body(response) -> bytes:
    async def read():
        if hasattr(response, "body_iterator"):
            return b"".join([c if isinstance(c, bytes) else c.encode() async for c in response.body_iterator])
        return response.body
    return asyncio.run(read())


STREAMING = ForwardedRequest("POST", "/v1/chat/completions", body=b'{"stream": true}', streams=True)
PLAIN = ForwardedRequest("POST", "/v1/completions", body=b"{}")


def test_began_tells_the_role_preamble_from_a_token():
    assert not _began(ROLE)
    assert _began(_event("Hi")) and _began(b"data: [DONE]\n\n") and _began(b'data: {"error": {}}\n\n')


def test_a_replica_dying_before_the_first_token_is_retried_unseen():
    died = FakeStream([HEAD, ROLE], fail=ActorDiedError())
    healthy = FakeStream([HEAD, ROLE, _event("Hi"), _event("!"), b"data: [DONE]\n\n"])
    engine = FakeHandle(died, healthy)
    response = asyncio.run(answer(engine, STREAMING, retries=2))
    assert engine.calls == 2 and died.cancelled
    assert _body(response) == ROLE + _event("Hi") + _event("!") + b"data: [DONE]\n\n"
    assert "content-length" not in response.headers and healthy.cancelled


def test_a_replica_dying_after_the_first_token_ends_the_stream_with_an_error():
    engine = FakeHandle(FakeStream([HEAD, ROLE, _event("Hi")], fail=ActorDiedError()))
    body = _body(asyncio.run(answer(engine, STREAMING, retries=2))).decode()
    assert engine.calls == 1
    assert body.startswith(ROLE.decode() + _event("Hi").decode())
    assert "died mid-stream; the answer is incomplete" in body and body.endswith("data: [DONE]\n\n")


def test_non_streaming_answers_are_retried_until_the_retries_run_out():
    ok = FakeStream([ResponseHead(200, [(b"content-type", b"application/json")]), b'{"ok"', b": 1}"])
    engine = FakeHandle(FakeStream([], fail=ActorDiedError()), ok)
    response = asyncio.run(answer(engine, PLAIN, retries=1))
    assert response.status_code == 200 and response.body == b'{"ok": 1}'
    engine = FakeHandle(*(FakeStream([], fail=ActorDiedError()) for _ in range(3)))
    response = asyncio.run(answer(engine, PLAIN, retries=2))
    assert response.status_code == 503 and engine.calls == 3
    assert "died 3 times; nothing was generated" in json.loads(response.body)["error"]["message"]


def test_an_unavailable_replica_is_not_retried():
    engine = FakeHandle(FakeStream([], fail=ActorUnavailableError("network", b"\x00" * 16)), FakeStream([HEAD]))
    response = asyncio.run(answer(engine, PLAIN, retries=2))
    assert response.status_code == 503 and engine.calls == 1
    assert "ActorUnavailableError" in json.loads(response.body)["error"]["message"]
