"""The server's refusals in OpenAI's error shape: :class:`APIError` (a status, a message and the field it names),
FastAPI's and Starlette's own refusals mapped onto it, and the OpenAPI description of each status.

It does not decide what is refused (``app.py``, ``requests.py``, ``fields.py``, ``guard.py``).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.serve.guard import error_body


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, param=exc.param, kind=exc.kind), status_code=exc.status,
                        headers=exc.headers)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own refusals (a body that is not UTF-8, an unknown route, a wrong method) in
    OpenAI's error shape."""
    return await api_error(request, APIError(exc.status_code, str(exc.detail), headers=exc.headers))


async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's validation errors as OpenAI-style 400s naming the first bad field."""
    first = exc.errors()[0]
    where = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        message, param = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    else:
        param = ".".join(where) or None
        message = f"{param or 'body'}: {first['msg']}" + ("" if "input" not in first or param is None else
                                                         f" (got {json.dumps(first['input'], default=str)[:80]})")
    return await api_error(request, APIError(400, message, param))


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error body, as every refusal has it."""

    error: ErrorDetail


ERROR_CODES = {400: "malformed, or asks for what this server does not do (the field is named)",
               401: "no valid API key (with --api-key)", 413: "the body is over --max-body-bytes",
               429: "the queue is full (Retry-After)", 500: "generation failed", 503: "the server is shutting down",
               504: "the request ran past --request-timeout"}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route's refusals."""
    return {code: {"model": ErrorBody, "description": ERROR_CODES[code]} for code in codes}
