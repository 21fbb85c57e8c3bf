"""forward.py with no model and no Ray: the routing text of each request shape, and the in-process ASGI call
(status, headers and streamed chunks as the app sent them; an early close tells the app its client left)."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from specdecode.serve.forward import ForwardedRequest, ResponseHead, call_asgi, routing_text


def _built(body: bytes) -> ForwardedRequest:
    return ForwardedRequest.build("POST", "/v1/completions", b"", [], body)


def test_routing_text_of_each_request_shape():
    assert routing_text({"prompt": "abc"}) == "abc"
    assert routing_text({"prompt": ["abc"]}) == "abc"
    assert routing_text({"prompt": [1, 2, 3]}) == ""
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]}]}
    assert _built(json.dumps(chat).encode()).routing_text == "be brief\nhi\n!"
    for junk in (b"", b"{not json", b"[1, 2]", json.dumps({"messages": "x"}).encode()):
        assert _built(junk).routing_text == ""


def test_streams_reads_the_body():
    assert _built(b'{"stream": true}').streams
    assert not _built(b'{"stream": "yes"}').streams
    assert not _built(b"{bad").streams


def _app(log: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.json()
        return JSONResponse({"got": body, "query": request.url.query}, status_code=201, headers={"x-a": "1"})

    @app.get("/stream")
    async def stream(request: Request):
        async def chunks():
            try:
                for i in range(1000):
                    yield f"chunk{i};"
                    await asyncio.sleep(0.001)
            finally:
                log.append("stream closed")
        return StreamingResponse(chunks(), media_type="text/plain")

    @app.get("/boom")
    async def boom():
        raise KeyError("boom")

    return app


async def _collect(app, request, limit=None):
    items = []
    gen = call_asgi(app, request)
    async for item in gen:
        items.append(item)
        if limit is not None and len(items) >= limit:
            await gen.aclose()
            break
    return items


def test_a_task_cancelled_while_waiting_for_the_app_ends_it_and_leaves_no_task():
    log: list[str] = []
    app = _app(log)

    async def run():
        async def consume():
            async for _ in call_asgi(app, ForwardedRequest("GET", "/stream")):
                pass
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)  # mid-stream, awaiting the next chunk
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.05)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(run()) == []
    assert log == ["stream closed"]


def test_an_app_that_finishes_after_its_body_is_not_cancelled():
    app, log = FastAPI(), []

    @app.get("/then-clean-up")
    async def then_clean_up():
        from starlette.background import BackgroundTask

        async def clean_up():
            await asyncio.sleep(0.02)
            log.append("cleaned up")
        return JSONResponse({"ok": True}, background=BackgroundTask(clean_up))

    async def run():
        items = await _collect(app, ForwardedRequest("GET", "/then-clean-up"))
        await asyncio.sleep(0.1)
        return items

    assert json.loads(b"".join(asyncio.run(run())[1:])) == {"ok": True}
    assert log == ["cleaned up"]


def test_call_asgi_returns_the_head_then_the_body():
    app = _app([])
    request = ForwardedRequest.build("POST", "/echo", b"a=1", [(b"content-type", b"application/json")],
                                     json.dumps({"prompt": "p"}).encode())
    items = asyncio.run(_collect(app, request))
    head, body = items[0], b"".join(items[1:])
    assert isinstance(head, ResponseHead) and head.status == 201
    assert (b"x-a", b"1") in head.headers
    assert json.loads(body) == {"got": {"prompt": "p"}, "query": "a=1"}


def test_an_early_close_ends_the_apps_stream():
    log: list[str] = []
    app = _app(log)

    async def run():
        items = await _collect(app, ForwardedRequest("GET", "/stream"), limit=4)
        await asyncio.sleep(0.05)  # the cancelled app runs its finally
        return items

    items = asyncio.run(run())
    assert items[0].status == 200 and items[1:] == [b"chunk0;", b"chunk1;", b"chunk2;"]
    assert log == ["stream closed"]


def test_an_unknown_path_and_an_app_error_are_answered_as_the_app_would():
    app = _app([])
    items = asyncio.run(_collect(app, ForwardedRequest("GET", "/nowhere")))
    assert items[0].status == 404
    items = asyncio.run(_collect(app, ForwardedRequest("GET", "/boom")))
    assert items[0].status == 500
