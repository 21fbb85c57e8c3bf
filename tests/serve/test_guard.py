"""guard.py in front of a real ASGI app (called in-process with ASGI messages): the API key on every
route but /health (and /metrics when public), constant-time and Bearer only; bodies over the limit are 413
whether declared or chunked, and bodies within it reach the app whole."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest
from fastapi import FastAPI, Request

from specdecode.serve.guard import HttpPolicy, Guard


def _app(policy: HttpPolicy) -> FastAPI:
    app = FastAPI()
    app.add_middleware(Guard, policy=policy)

    @app.post("/v1/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> dict:
        return {"m": 1}
    return app


@dataclass
class Reply:
    status_code: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def _call(policy: HttpPolicy, method: str, path: str, headers: dict[str, str] | None = None,
          content: bytes | list[bytes] = b"", declare: bool = True) -> Reply:
    """One request through the app: ``content`` whole (its length declared unless ``declare`` is false) or as
    chunks (a list, no length declared)."""
    chunks = content if isinstance(content, list) else [content]
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if isinstance(content, bytes) and declare:
        raw.append((b"content-length", str(len(content)).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "headers": raw, "scheme": "http",
             "server": ("test", 80), "client": ("127.0.0.1", 1), "root_path": ""}
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(_app(policy)(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return Reply(start["status"], {k.decode(): v.decode() for k, v in start["headers"]},
                 b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


KEYED = HttpPolicy(api_key="s3cret")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
                                     {"Authorization": "s3cret"}])
def test_without_the_key_every_route_but_health_is_401(headers):
    for method, path in (("POST", "/v1/echo"), ("GET", "/metrics")):
        r = _call(KEYED, method, path, headers=headers, content=b"{}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    assert _call(KEYED, "GET", "/health").status_code == 200


def test_with_the_key_the_request_goes_through():
    r = _call(KEYED, "POST", "/v1/echo", headers={"Authorization": "Bearer s3cret"}, content=b"x" * 10)
    assert r.status_code == 200 and r.json() == {"bytes": 10}
    assert _call(HttpPolicy(), "POST", "/v1/echo", content=b"{}").status_code == 200  # no key: open
    assert _call(HttpPolicy(api_key="k", metrics_public=True), "GET", "/metrics").status_code == 200


def test_bodies_over_the_limit_are_413_declared_or_chunked():
    small = HttpPolicy(max_body_bytes=100)
    declared = _call(small, "POST", "/v1/echo", content=b"x" * 101)
    assert declared.status_code == 413 and "101 bytes" in declared.json()["error"]["message"]

    chunked = _call(small, "POST", "/v1/echo", content=[b"x" * 30] * 5)  # no content-length: sent in chunks
    assert chunked.status_code == 413 and "over the 100 bytes" in chunked.json()["error"]["message"]
    assert _call(small, "POST", "/v1/echo", content=[b"x" * 30] * 3).json() == {"bytes": 90}
    undeclared = _call(small, "POST", "/v1/echo", content=b"x" * 101, declare=False)
    assert undeclared.status_code == 413


def test_an_empty_key_a_zero_limit_or_deadline_is_refused():
    with pytest.raises(ValueError, match="not empty"):
        HttpPolicy(api_key=" ")
    with pytest.raises(ValueError, match="at least 1"):
        HttpPolicy(max_body_bytes=0)
    with pytest.raises(ValueError, match="--request-timeout must be positive"):
        HttpPolicy(request_timeout_s=0.0)


def test_the_key_comes_from_the_flag_else_the_environment(monkeypatch):
    monkeypatch.setenv("SPECDECODE_API_KEY", "from-env")
    assert HttpPolicy.key_from(None) == "from-env" and HttpPolicy.key_from("flag") == "flag"
    monkeypatch.delenv("SPECDECODE_API_KEY")
    assert HttpPolicy.key_from(None) is None


def test_paths_are_matched_exactly_and_the_scheme_in_any_case():
    assert _call(KEYED, "GET", "/health/").status_code == 401  # only /health itself is open
    assert _call(KEYED, "GET", "/metrics", headers={"Authorization": "bearer s3cret"}).status_code == 200
    assert not KEYED.allows("/v1/models", "Bearer s3cretx") and KEYED.allows("/v1/models", "Bearer  s3cret ")


def test_keys_that_could_never_match_are_refused_when_configured():
    for key in (" k", "k ", "clé"):
        with pytest.raises(ValueError, match="ASCII, not empty, without spaces"):
            HttpPolicy(api_key=key)
    assert "s3cret" not in repr(KEYED)


def test_a_websocket_is_refused_when_a_key_is_set():
    sent: list[dict] = []
    messages = [{"type": "websocket.connect"}]

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": "/v1/echo", "headers": [], "query_string": b""}
    asyncio.run(_app(KEYED)(scope, receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008}]
