"""The OpenAI-compatible HTTP API over an :class:`~specdecode.serve.loop.EngineLoop` (FastAPI).

Endpoints: ``POST /v1/completions`` and ``/v1/chat/completions`` (JSON or SSE streaming; n = 1),
``GET /v1/models``, ``/health`` and ``/metrics`` (Prometheus, vLLM's names). Bad input gets a 400 with
an OpenAI-style error body naming the field (``{"error": {"message", "type", "param", "code"}}``); a
full queue a 429 with ``Retry-After``; a client that goes away cancels its request, which frees its KV
slot at the next step. Each response's ``usage`` carries the request's speculation figures.

The routes are plain functions over one explicit state object, :class:`ServedModel` (``app.state.served``).
It does not step the engine (``loop.py``) nor parse command lines (``flags.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.batch.scheduler import QueueFullError
from specdecode.batch.sequence import Output, Sequence
from specdecode.grammar import GrammarError
from specdecode.logprobs import TokenLogprob
from specdecode.models.tokenizer import ChatTemplateError
from specdecode.sampling import SamplingParams
from specdecode.serve.fields import TEXT_FIELDS, check_extra_fields, unencodable_text
from specdecode.serve.guard import Guard, HttpPolicy, error_body
from specdecode.serve.loop import EngineLoop
from specdecode.serve.metrics import ServeMetrics
from specdecode.serve.structured import FieldError, ResponseFormat, StructuredOutputs, grammar_of

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}
RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 1.0  # how often a waiting request checks that its client is still there
CANCEL_GRACE_S = 10.0  # a cancel the engine has not confirmed by then: its thread is taken to be stuck


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers


class StreamOptions(BaseModel):
    include_usage: bool = False


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


def joined(content: str | list[ContentPart]) -> str:
    """A message's or prediction's text: a string, or its text parts joined."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class PredictedOutput(BaseModel):
    """OpenAI's ``prediction``: text the completion is expected to be mostly made of, drafted where it follows."""

    type: Literal["content"]
    content: str | list[ContentPart]


class _Sampling(BaseModel):
    """Fields both endpoints share. Others are kept aside for ``fields.check_extra_fields``: refused where they
    ask for what this server does not do, else ignored."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # an extension (vLLM's): 0 or -1 = off
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    prediction: PredictedOutput | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension: json, regex, choice

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, max(0, self.top_k), self.top_p, self.seed)

    def top_logprobs_asked(self) -> int | None:
        """Alternatives per token to report with log-probabilities; None = no log-probabilities."""
        raise NotImplementedError

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", "stop")
        return stops


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)  # alternatives per token (OpenAI's legacy completions: 0-5)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_off(cls, value: Any) -> Any:
        if isinstance(value, bool):  # false: off, as clients send it; true says no count
            if value:
                raise ValueError("logprobs takes a number of alternatives, 0-5")
            return None
        return value

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def top_logprobs_asked(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class OutputRelay:
    """Hands outputs from the engine's thread to the event loop with one wake-up of the loop for the outputs
    that arrive together (a step's, one per running request) rather than one per output: each wake-up costs
    both threads CPU. Each queue gets its outputs in the order they came.

    Args:
        loop: the event loop that reads the queues.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Output]] = []

    def put(self, queue: asyncio.Queue, output: Output) -> None:
        """Queues ``output`` for ``queue`` (from any thread); wakes the loop unless a wake-up is already due."""
        with self._lock:
            self._pending.append((queue, output))
            if len(self._pending) > 1:  # the wake-up that the first of them asked for has not run yet
                return
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop has closed: nobody reads these any more, and the next put must wake again
            with self._lock:
                self._pending.clear()

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, output in pending:
            queue.put_nowait(output)


class _Handle:
    """One request's outputs, moved from the engine's thread to the event loop's. A streamed request hands over
    every output; a whole one only its last (its texts gather on the engine's thread).

    Args:
        relay: what hands outputs to the event loop.
        stream: whether the request streams.
    """

    def __init__(self, relay: OutputRelay, stream: bool) -> None:
        self._relay = relay
        self.stream = stream
        self.outputs: asyncio.Queue[Output] = asyncio.Queue()
        self.texts: list[str] = []  # a whole request's texts before its last output
        self.logprobs: list[TokenLogprob] = []  # and their tokens' log-probabilities, if asked
        self.seq: Sequence | None = None
        self.came = time.monotonic()
        self.timed_out = False  # cancelled at its deadline

    def on_output(self, seq: Sequence, output: Output) -> None:
        if not self.stream and output.finish_reason is None:
            self.texts.append(output.text)  # read only after the last output, which the loop gets after this
            self.logprobs += output.logprobs or []
            return
        self._relay.put(self.outputs, output)


def usage(seq: Sequence) -> dict[str, Any]:
    """A finished request's ``usage``, with its speculation figures."""
    s = seq.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": len(seq.generated),
            "total_tokens": s.prompt_tokens + len(seq.generated),
            # OpenAI's meaning: the prediction's tokens that appeared in the completion (drafted and kept), and the
            # rest of the prediction's tokens.
            "completion_tokens_details": {
                "accepted_prediction_tokens": s.prediction_accepted,
                "rejected_prediction_tokens": max(0, s.prediction_tokens - s.prediction_accepted)},
            "speculation": {"drafted_tokens": s.drafted_tokens, "accepted_tokens": s.accepted_tokens,
                            "mean_accepted_length": round(s.mean_accepted_length, 4)}}


def failed(seq: Sequence) -> APIError:
    return APIError(500, f"generation failed: {seq.error}", kind="server_error")


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class ServedModel:
    """What the routes serve: the engine loop, the name clients ask for, the metrics, and whether new
    requests are still accepted (not while shutting down). One per application, at ``app.state.served``.

    Args:
        loop: the engine loop (started and stopped by the application's lifespan).
        name: the model name clients pass.
        metrics: the Prometheus metrics ``/metrics`` renders.
        timeout_s: a request still running this long after it was accepted is cancelled (None: no deadline).
    """

    def __init__(self, loop: EngineLoop, name: str, metrics: ServeMetrics, timeout_s: float | None = None) -> None:
        self.loop, self.name, self.metrics, self.timeout_s = loop, name, metrics, timeout_s
        self.engine = loop.engine
        self.tokenizer = loop.engine.tokenizer
        self.created = int(time.time())
        self.accepting = True
        self._relay: OutputRelay | None = None

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise APIError(400, f"model {name!r} is not served here; this server serves {self.name!r}", "model")

    def budget(self, body: _Sampling, prompt_len: int) -> int:
        """The completion's token budget: what the request asks, within what a KV slot holds."""
        asked = body.max_completion_tokens or body.max_tokens
        max_len = self.engine.max_len
        room = max_len - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt is {prompt_len} tokens; this server holds at most {max_len} "
                                "tokens per request (prompt + completion)", "prompt")
        if asked is not None and asked > room:
            raise APIError(400, f"max_tokens {asked} plus the prompt's {prompt_len} tokens exceed the "
                                f"{max_len} tokens this server holds per request", "max_tokens")
        return asked or room

    def encode_prompt(self, prompt: str | list[str] | list[int]) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request (n = 1); got {len(prompt)}", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode_prompt(prompt) if prompt else []
        else:
            ids = list(prompt)
            vocab = self.engine.target.config.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}", "prompt")
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        return ids

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise APIError(400, f"model {self.name!r} has no chat template; use /v1/completions", "messages")
        # No content (OpenAI allows it beside tool calls) renders as empty: templates add strings to it.
        rendered = [{"role": m.role, "content": "" if m.content is None else joined(m.content)} for m in messages]
        try:
            return self.tokenizer.encode_prompt(self.tokenizer.apply_chat_template(rendered))
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), "messages") from None

    async def start(self, ids: list[int], body: _Sampling) -> _Handle:
        """Submits the request to the engine loop; a full queue is a 429, a refused request a 400."""
        if not self.accepting or not self.loop.alive:
            raise APIError(503, "the server is shutting down", kind="service_unavailable")
        running = asyncio.get_running_loop()
        if self._relay is None or self._relay.loop is not running:  # made here: it needs the running loop
            self._relay = OutputRelay(running)
        handle = _Handle(self._relay, body.stream)
        prediction = joined(body.prediction.content) if body.prediction is not None else None
        try:
            structured = grammar_of(body.response_format, body.structured_outputs)
        except FieldError as exc:
            raise APIError(400, str(exc), exc.param) from None
        grammar, grammar_field = structured if structured is not None else (None, None)
        if grammar is not None:  # compiled here, so that a large schema does not hold up the engine's thread
            try:
                await asyncio.to_thread(lambda: self.engine.grammar_compiler().compile(grammar))
            except GrammarError as exc:
                raise APIError(400, str(exc), grammar_field) from None
        future = self.loop.submit(handle.on_output, prompt=ids, sampling=body.sampling(),
                                  max_new_tokens=self.budget(body, len(ids)), stop=body.stops(), prediction=prediction,
                                  logprobs=body.top_logprobs_asked(), grammar=grammar)
        try:
            handle.seq = await asyncio.wrap_future(future)
        except QueueFullError as exc:
            raise APIError(429, str(exc), kind="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
        except GrammarError as exc:
            raise APIError(400, str(exc), grammar_field)
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt")
        return handle

    async def outputs(self, handle: _Handle, request: Request) -> AsyncIterator[Output]:
        """The request's outputs until its last; a client that goes away or a deadline that passes (checked
        beside the outputs rather than at each) cancels the request, whose last output then ends this."""
        watcher = asyncio.create_task(self._watch(handle, request))
        try:
            while True:
                out = await handle.outputs.get()
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            watcher.cancel()
            if not handle.seq.finished:
                self.loop.cancel(handle.seq)

    async def _watch(self, handle: _Handle, request: Request) -> None:
        """Cancels the request when its client has gone or its deadline has passed, at most a second late; ends
        it with an error output itself when the engine's thread has stopped (nothing else would)."""
        cancelled_at = None
        while True:
            left = None if self.timeout_s is None or cancelled_at is not None else \
                handle.came + self.timeout_s - time.monotonic()
            await asyncio.sleep(DISCONNECT_POLL_S if left is None else max(0.0, min(DISCONNECT_POLL_S, left)))
            if handle.seq.finished:  # its last output is on its way (the engine sets this before handing it over)
                return
            unanswered = cancelled_at is not None and time.monotonic() - cancelled_at > CANCEL_GRACE_S
            if not self.loop.alive or unanswered:
                if handle.timed_out:  # still the deadline's answer
                    handle.outputs.put_nowait(Output([], "", "cancelled"))
                    return
                handle.seq.error = handle.seq.error or (
                    "the engine stopped" if not self.loop.alive else
                    f"the engine did not answer a cancel within {CANCEL_GRACE_S:g} s")
                handle.outputs.put_nowait(Output([], "", "error"))
                return
            if cancelled_at is None:
                handle.timed_out = self.timeout_s is not None and time.monotonic() - handle.came >= self.timeout_s
                if handle.timed_out or await request.is_disconnected():
                    self.loop.cancel(handle.seq)
                    cancelled_at = time.monotonic()

    def deadline_error(self) -> APIError:
        return APIError(504, f"the request ran past this server's {self.timeout_s:g} s deadline (--request-timeout) "
                             "and was cancelled", kind="timeout")

    async def respond(self, request: Request, body: _Sampling, ids: list[int], chat: bool) -> Response:
        """The answer to a completion (``chat`` false) or chat request: one JSON body, or an SSE stream."""
        handle = await self.start(ids, body)
        reply = _Reply(chat, {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                              "model": self.name}, self.tokenizer)
        if not body.stream:
            return await self._whole(request, handle, reply)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(self._events(request, handle, reply, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _whole(self, request: Request, handle: _Handle, reply: _Reply) -> Response:
        async with contextlib.aclosing(self.outputs(handle, request)) as outputs:
            last = [out async for out in outputs]
        text = handle.texts + [out.text for out in last]
        seq = handle.seq
        finish = last[-1].finish_reason  # the engine's, or the watcher's when the engine stopped
        if finish == "error":
            raise failed(seq)
        if finish == "cancelled":
            if handle.timed_out:
                raise self.deadline_error()
            return Response(status_code=499)  # the client is gone: nobody reads this
        logprobs = [*handle.logprobs, *(lp for out in last for lp in out.logprobs or [])] \
            if seq.request.logprobs is not None else None
        return JSONResponse(reply.whole("".join(text), FINISH[finish], usage(seq), logprobs))

    async def _events(self, request: Request, handle: _Handle, reply: _Reply,
                      include_usage: bool) -> AsyncIterator[str]:
        if reply.chat:
            yield sse(reply.chunk(None, None, first=True))
        ended = None  # the last output's finish reason (the watcher's when the engine did not answer)
        async with contextlib.aclosing(self.outputs(handle, request)) as outputs:
            async for out in outputs:
                ended = out.finish_reason
                late = out.finish_reason == "cancelled" and handle.timed_out
                if out.finish_reason == "error" or late:
                    err = self.deadline_error() if late else failed(handle.seq)
                    yield sse(error_body(err.message, kind=err.kind))
                    break
                finish = FINISH[out.finish_reason] if out.finish_reason else None
                if out.text or finish or out.logprobs:
                    yield sse(reply.chunk(out.text, finish, logprobs=out.logprobs))
        if include_usage and ended not in (None, "error", "cancelled"):
            yield sse(reply.usage_chunk(usage(handle.seq)))
        yield "data: [DONE]\n\n"


@dataclass
class _Reply:
    """One answer's bodies in OpenAI's shapes: ``base`` is its id, creation time and model."""

    chat: bool
    base: dict[str, Any]
    tokenizer: Any = None  # names the tokens of log-probabilities
    text_offset: int = 0  # a completion's characters before the next log-probabilities' first token

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def whole(self, content: str, finish: str, usage: dict[str, Any],
              logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}} if self.chat else
                  {"index": 0, "text": content})
        choice["logprobs"] = self.logprobs(logprobs)
        choice["finish_reason"] = finish
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self.base, "object": kind, "choices": [choice], "usage": usage}

    def chunk(self, text: str | None, finish: str | None, first: bool = False,
              logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": self.logprobs(logprobs), "finish_reason": finish}
        return {**self.base, "object": self.chunk_kind, "choices": [choice]}

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` of a choice: chat's ``content`` list, or a completion's parallel lists."""
        if entries is None:
            return None
        name = self._token_text
        if self.chat:
            def entry(token: int, logprob: float) -> dict[str, Any]:
                return {"token": name(token), "logprob": logprob, "bytes": self._token_bytes(token)}
            return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                                for lp in entries], "refusal": None}
        offsets = []
        for lp in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(name(lp.token))
        return {"tokens": [name(lp.token) for lp in entries], "token_logprobs": [lp.logprob for lp in entries],
                "top_logprobs": [{name(t): v for t, v in lp.top} for lp in entries], "text_offset": offsets}

    def _token_text(self, token: int) -> str:
        # One token alone: a piece of a multi-byte character shows as U+FFFD (``bytes`` has its own bytes).
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer is not None else str(token)

    def _token_bytes(self, token: int) -> list[int]:
        return list(self.tokenizer.token_bytes(token) if self.tokenizer is not None else str(token).encode())

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self.base, "object": self.chunk_kind, "choices": [], "usage": usage}


def _served(request: Request) -> ServedModel:
    return request.app.state.served


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


def _check_fields(body: _Sampling) -> None:
    """A 400 for a field this server does not implement, or for text that is not valid Unicode."""
    refused = check_extra_fields(body.model_extra or {})
    if refused is not None:
        raise APIError(400, refused[1], refused[0])
    bad = unencodable_text(body.model_dump(exclude_none=True, by_alias=True, include=set(TEXT_FIELDS)))
    if bad is not None:
        raise APIError(400, f"{bad}: the text is not valid Unicode (a lone surrogate)", bad)


async def completions(request: Request, body: CompletionRequest) -> Response:
    served = _served(request)
    _check_fields(body)
    served.check_model(body.model)
    return await served.respond(request, body, served.encode_prompt(body.prompt), chat=False)


async def chat_completions(request: Request, body: ChatRequest) -> Response:
    served = _served(request)
    _check_fields(body)
    served.check_model(body.model)
    return await served.respond(request, body, served.encode_chat(body.messages), chat=True)


async def models(request: Request) -> dict[str, Any]:
    served = _served(request)
    return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                        "owned_by": "specdecode", "max_model_len": served.engine.max_len}]}


async def health(request: Request) -> Response:
    if not _served(request).loop.alive:
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics_endpoint(request: Request) -> Response:
    metrics = _served(request).metrics
    return Response(metrics.render(), media_type=metrics.content_type)


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


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route's refusals."""
    return {code: {"model": ErrorBody, "description": ERROR_CODES[code]} for code in codes}


def build_app(loop: EngineLoop, model_name: str, metrics: ServeMetrics, policy: HttpPolicy = HttpPolicy(),
              lifespan=None) -> FastAPI:
    """The FastAPI application serving ``loop``'s engine under ``model_name``, behind ``policy``'s key and body
    limit (``guard.py``); ``lifespan`` starts and stops the loop with the server (see ``command.py``)."""
    app = FastAPI(title="specdecode", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(Guard, policy=policy)
    app.state.served = ServedModel(loop, model_name, metrics, policy.request_timeout_s)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, bad_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    generate = {200: {"description": "the completion: JSON, or with stream: true server-sent events",
                      "content": {"text/event-stream": {}}},
                **_errors(400, 401, 413, 429, 500, 503, 504)}  # 500: a failed step ends the requests it served
    app.add_api_route("/v1/completions", completions, methods=["POST"], responses=generate)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], responses=generate)
    app.add_api_route("/v1/models", models, methods=["GET"], responses=_errors(401))
    app.add_api_route("/health", health, methods=["GET"], responses={503: {"description": "the engine stopped"}})
    app.add_api_route("/metrics", metrics_endpoint, methods=["GET"], responses=_errors(401),
                      response_class=PlainTextResponse)  # Prometheus' text format
    return app
