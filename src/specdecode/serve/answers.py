"""A request's answer from its running choices: one JSON body, or one SSE stream interleaving the choices' chunks
(``n`` choices, each its own sequence in the engine); for ``/v1/responses``, its typed events.

A choice's text is read for tool calls where the request has tools. A choice that fails ends the whole answer (a 500
body, or an error event closing the stream), and the others are cancelled with it. It does not start requests or
watch their clients (``app.py``'s ``ServedModel``) and does not shape the bodies (``replies.py``, ``responses.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, AsyncIterator, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdecode.serve.errors import APIError
from specdecode.serve.guard import error_body
from specdecode.serve.relay import Handle
from specdecode.serve.replies import FINISH, Reply, failed, sse, usage
from specdecode.serve.responses import ResponseEvents
from specdecode.serve.tools import StreamedCalls, ToolPlan, message_of

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_END = object()


class Serving(Protocol):
    """What an answer reads from the served model (``app.ServedModel``)."""

    name: str
    tokenizer: Any

    def outputs(self, handle: Handle, request: Request) -> AsyncIterator[Any]: ...
    async def collect(self, request: Request, handle: Handle) -> tuple[str, str, list | None] | None: ...
    def deadline_error(self) -> APIError: ...


def merged_usage(handles: list[Handle]) -> dict[str, Any]:
    """``usage`` over the choices: the prompt once, the completions and the speculation figures summed."""
    parts = [usage(h.seq) for h in handles]
    total = parts[0]
    for part in parts[1:]:
        total["completion_tokens"] += part["completion_tokens"]
        total["total_tokens"] += part["completion_tokens"]
        for key in ("accepted_prediction_tokens", "rejected_prediction_tokens"):
            total["completion_tokens_details"][key] += part["completion_tokens_details"][key]
        for key in ("drafted_tokens", "accepted_tokens"):
            total["speculation"][key] += part["speculation"][key]
    forwards = sum(h.seq.stats.target_forwards for h in handles)
    if len(parts) > 1 and forwards:
        total["speculation"]["mean_accepted_length"] = round(sum(h.seq.stats.tokens_generated for h in handles)
                                                             / forwards, 4)
    return total


async def answer(served: Serving, request: Request, handles: list[Handle], chat: bool, stream: bool,
                 include_usage: bool, tools: ToolPlan | None) -> Response:
    """The answer to a completion (``chat`` false) or chat request over its choices' ``handles``."""
    base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": served.name}
    replies = [Reply(chat, base, served.tokenizer, index=i) for i in range(len(handles))]
    if not stream:
        return await _whole(served, request, handles, replies, tools)
    return StreamingResponse(_events(served, request, handles, replies, include_usage, tools),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def _whole(served: Serving, request: Request, handles: list[Handle], replies: list[Reply],
                 tools: ToolPlan | None) -> Response:
    collected = await asyncio.gather(*(served.collect(request, h) for h in handles))
    if any(c is None for c in collected):
        return Response(status_code=499)  # the client is gone: nobody reads this
    choices = []
    for reply, (text, finish, logprobs) in zip(replies, collected):
        message, called = message_of(text, tools, cut=finish == "length") if reply.chat else (None, False)
        finish = "tool_calls" if called and finish != "length" else FINISH[finish]
        choices += reply.whole(text, finish, {}, logprobs, message)["choices"]
    body = replies[0].whole("", "stop", merged_usage(handles))
    return JSONResponse({**body, "choices": choices})


async def _choice_chunks(served: Serving, request: Request, handle: Handle, reply: Reply,
                         calls: StreamedCalls | None) -> AsyncIterator[dict[str, Any] | APIError]:
    """One choice's chunks, then an APIError where it failed or ran past the deadline."""
    if reply.chat:
        yield reply.chunk(None, None, first=True)
    async with contextlib.aclosing(served.outputs(handle, request)) as outputs:
        async for out in outputs:
            late = out.finish_reason == "cancelled" and handle.timed_out
            if out.finish_reason == "error" or late:
                yield served.deadline_error() if late else failed(handle.seq)
                return
            finish = FINISH[out.finish_reason] if out.finish_reason else None
            if calls is not None:  # the text goes out as content and tool-call deltas
                for delta in calls.feed(out.text) + (calls.finish() if finish else []):
                    yield reply.delta_chunk(delta)
                if finish or out.logprobs:
                    yield reply.chunk(None, "tool_calls" if finish == "stop" and calls.called else finish,
                                      logprobs=out.logprobs)
            elif out.text or finish or out.logprobs:
                yield reply.chunk(out.text, finish, logprobs=out.logprobs)


async def _interleaved(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of several async iterators as they come; closing this closes them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[Any]) -> None:
        try:
            async with contextlib.aclosing(stream) as items:
                async for item in items:
                    await queue.put(item)
        finally:
            queue.put_nowait(_END)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        live = len(tasks)
        while live:
            item = await queue.get()
            if item is _END:
                live -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def _events(served: Serving, request: Request, handles: list[Handle], replies: list[Reply],
                  include_usage: bool, tools: ToolPlan | None) -> AsyncIterator[str]:
    streams = [_choice_chunks(served, request, h, r, StreamedCalls(tools) if tools is not None else None)
               for h, r in zip(handles, replies)]
    failed_with = None
    async with contextlib.aclosing(_interleaved(streams)) as chunks:
        async for chunk in chunks:
            if isinstance(chunk, APIError):
                failed_with = chunk
                yield sse(error_body(chunk.message, kind=chunk.kind))
                break
            yield sse(chunk)
    ended = [h.seq.finish_reason for h in handles]
    if include_usage and failed_with is None and all(e not in (None, "error", "cancelled") for e in ended):
        yield sse(replies[0].usage_chunk(merged_usage(handles)))
    yield "data: [DONE]\n\n"


async def response_events(served: Serving, request: Request, handle: Handle, events: ResponseEvents,
                          tools: ToolPlan | None) -> AsyncIterator[str]:
    """A streamed ``/v1/responses`` answer: its typed events, then an ``error`` event if generation fails."""
    for event in events.start():
        yield event
    calls = StreamedCalls(tools) if tools is not None else None
    async with contextlib.aclosing(served.outputs(handle, request)) as outputs:
        async for out in outputs:
            if out.finish_reason in ("error", "cancelled"):
                if out.finish_reason == "error" or handle.timed_out:
                    err = served.deadline_error() if out.finish_reason == "cancelled" else failed(handle.seq)
                    yield events.shape.event("error", code=err.kind, message=err.message, param=None)
                return
            deltas = ([{"content": out.text}] if out.text else []) if calls is None else \
                calls.feed(out.text) + (calls.finish() if out.finish_reason else [])
            for delta in deltas:
                for event in events.delta(delta):
                    yield event
            if out.finish_reason:
                for event in events.finish(usage(handle.seq), out.finish_reason):
                    yield event
