"""Who may call the server, and how large a request may be: an ASGI middleware in front of the API, and the
policy it enforces (which also holds the per-request deadline that ``app.py`` enforces).

With an API key (``--api-key``, or ``$SPECDECODE_API_KEY``), every route but ``/health`` (and ``/metrics``
with ``--metrics-public``) answers 401 unless the request carries ``Authorization: Bearer <key>``, as vLLM's
and llama-server's ``--api-key`` do. A request body over ``--max-body-bytes`` is a 413, whether its length was
declared or sent in chunks. Errors have OpenAI's body (``{"error": {"message", "type", "param", "code"}}``).

It does not look at what a body says (``fields.py`` and ``requests.py`` do) nor limit how many requests come.
"""

from __future__ import annotations

import hmac
import json
import os
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

API_KEY_ENV = "SPECDECODE_API_KEY"
OPEN_PATHS = ("/health",)
UNAUTHORIZED = "a valid API key is needed: send `Authorization: Bearer <key>`"

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class HttpPolicy:
    """Who may call the server, how large a request body may be, and how long a request may run.

    Args:
        api_key: the key clients must send as ``Authorization: Bearer <key>``; None = anyone may call.
        metrics_public: ``/metrics`` answers without the key.
        max_body_bytes: the largest request body accepted.
        request_timeout_s: a request still running this long after it was accepted (read, checked, tokenized)
            is cancelled (``app.py``: a 504, or an error event ending its stream); None = no deadline.

    Raises:
        ValueError: an empty key, a body limit below 1 byte, or a deadline that is not positive.
    """

    api_key: str | None = field(default=None, repr=False)  # never printed with a config
    metrics_public: bool = False
    max_body_bytes: int = 8 * 2**20
    request_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.api_key is not None and (not self.api_key.strip() or self.api_key != self.api_key.strip()
                                         or not self.api_key.isascii()):
            raise ValueError("--api-key (or $SPECDECODE_API_KEY) must be ASCII, not empty, without spaces around it")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be at least 1 (got {self.max_body_bytes})")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be positive (got {self.request_timeout_s})")

    @staticmethod
    def key_from(flag: str | None) -> str | None:
        """The key a server uses: the flag's, else ``$SPECDECODE_API_KEY``'s, else None."""
        return flag if flag is not None else os.environ.get(API_KEY_ENV) or None

    def allows(self, path: str, authorization: str | None) -> bool:
        """Whether a request for ``path`` with this ``Authorization`` header value may go on."""
        if self.api_key is None or path in OPEN_PATHS or (self.metrics_public and path == "/metrics"):
            return True
        scheme, _, token = (authorization or "").partition(" ")  # the header as sent: latin-1 bytes
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1", "replace"),
                                                                  self.api_key.encode())


class Guard:
    """ASGI middleware enforcing an :class:`HttpPolicy` in front of ``app``."""

    def __init__(self, app: Callable, policy: HttpPolicy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and self.policy.api_key is not None:  # (none are served) not without the key
            await receive()  # websocket.connect
            return await send({"type": "websocket.close", "code": 1008})
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if not self.policy.allows(scope["path"], headers.get("authorization")):
            return await error(send, 401, UNAUTHORIZED, code="invalid_api_key",
                               headers=[(b"www-authenticate", b"Bearer")])
        limit = self.policy.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return await error(send, 413,
                               f"the request body is {int(declared)} bytes; this server takes at most {limit}")
        parts, size, more = [], 0, True
        while more:  # read whole (and counted, however it is sent), then handed to the app in one message
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay(message, receive), send)
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            more = message.get("more_body", False)
            if size > limit:
                return await error(send, 413, f"the request body is over the {limit} bytes this server takes")
        whole = {"type": "http.request", "body": b"".join(parts), "more_body": False}
        await self.app(scope, _replay(whole, receive), send)


def _replay(first: Message, receive: Receive) -> Receive:
    """A receive that gives ``first``, then what ``receive`` gives (a disconnect, later)."""
    pending = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()
    return replayed


def error_body(message: str, code: str | None = None, param: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``), for every refusal and failure."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def error(send: Send, status: int, message: str, code: str | None = None,
                headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """An OpenAI-style error answer, sent whole."""
    body = json.dumps(error_body(message, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
