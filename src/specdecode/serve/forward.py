"""An HTTP request carried between processes, and the in-process call that answers it with an ASGI app.

The Ray ingress (``ray_app.py``) reads each HTTP request into a :class:`ForwardedRequest` and hands it to
an engine replica, which answers it with the same FastAPI app ``specdecode serve`` runs
(:func:`call_asgi`): one implementation of the API, its validation and its errors, however it is
deployed. The request keeps the text its answer starts from (:attr:`ForwardedRequest.routing_text`)
so that a router can send requests sharing a prefix to the same replica.

It does not route, retry or know Ray (``ray_app.py``, ``ray_router.py``).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator


@dataclass
class ResponseHead:
    """The status line and headers of a forwarded answer, sent before its body."""

    status: int
    headers: list[tuple[bytes, bytes]]


@dataclass
class ForwardedRequest:
    """One HTTP request, picklable.

    Args:
        method: ``GET``, ``POST``...
        path: the URL path as the app's routes see it (``/v1/chat/completions``).
        query: the raw query string.
        headers: raw header pairs, lower-case names.
        body: the request body.
        routing_text: the prompt, or the chat messages' contents joined, for prefix-aware routing;
            empty where the request carries no text (or its body is not JSON).
        streams: whether the body asks for an SSE stream (the replica's app decides what is valid).
    """

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    routing_text: str = ""
    streams: bool = False

    @classmethod
    def build(cls, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
              body: bytes) -> "ForwardedRequest":
        """The request with its routing text and stream flag read from the body (parsed once)."""
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None
        return cls(method, path, query, headers, body, routing_text(payload),
                   isinstance(payload, dict) and payload.get("stream") is True)


def routing_text(payload: Any) -> str:
    """The text a completion or chat request's answer starts from (``payload`` is its parsed JSON body), as
    far as routing needs it: the prompt string, or the messages' text contents in order ("" where none)."""
    if not isinstance(payload, dict):
        return ""
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt[0]
    parts: list[str] = []
    for message in payload.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "\n".join(parts)


async def call_asgi(app: Any, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
    """Runs ``app`` on ``request`` in this process: yields the :class:`ResponseHead`, then the body's
    chunks as the app sends them. Closed or cancelled before the body's end (the caller went away), it
    tells the app the client disconnected and cancels it, so that a streaming request's sequence is
    cancelled too; after the body's end the app is left to finish."""
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = complete = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
             "query_string": request.query, "root_path": "", "headers": request.headers, "client": None,
             "server": None, "state": {}}
    task = asyncio.ensure_future(app(scope, receive, send))
    getter: asyncio.Future | None = None
    try:
        while True:
            getter = asyncio.ensure_future(messages.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():  # the app returned (or raised) with nothing more queued
                getter.cancel()
                if messages.empty():
                    task.result()  # re-raises what the app raised
                    return
                message = messages.get_nowait()
            else:
                message = getter.result()
            if message["type"] == "http.response.start":
                yield ResponseHead(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    complete = True
                    return
    finally:
        if getter is not None and not getter.done():
            getter.cancel()
        if not complete:
            disconnected.set()
            if not task.done():
                task.cancel()
