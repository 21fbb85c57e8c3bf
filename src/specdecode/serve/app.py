"""The OpenAI-compatible HTTP API over an :class:`~specdecode.serve.loop.EngineLoop` (FastAPI).

Endpoints: ``POST /v1/completions``, ``/v1/chat/completions`` (JSON or SSE streaming; n = 1; tool calls on
chat, ``tools.py``) and ``/v1/responses`` (stateless, ``responses.py``),
``GET /v1/models``, ``/health`` and ``/metrics`` (Prometheus, vLLM's names). Bad input gets a 400 with
an OpenAI-style error body naming the field (``{"error": {"message", "type", "param", "code"}}``); a
full queue a 429 with ``Retry-After``; a client that goes away cancels its request, which frees its KV
slot at the next step. Each response's ``usage`` carries the request's speculation figures.

The routes are plain functions over one explicit state object, :class:`ServedModel` (``app.state.served``).
It does not step the engine (``loop.py``), parse command lines (``flags.py``), define the request bodies
(``requests.py``), shape the answers (``replies.py``) or the errors (``errors.py``), or move outputs between
threads (``relay.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.batch.scheduler import QueueFullError
from specdecode.batch.sequence import Output
from specdecode.grammar import GrammarError
from specdecode.models.tokenizer import ChatTemplateError
from specdecode.serve.answers import SSE_HEADERS, answer, response_events
from specdecode.serve.errors import APIError, api_error, bad_request, error_responses, http_error
from specdecode.serve.fields import RESPONSES_REFUSED, check_extra_fields
from specdecode.serve.guard import Guard, HttpPolicy
from specdecode.serve.loop import EngineLoop
from specdecode.serve.metrics import ServeMetrics
from specdecode.serve.relay import Handle, OutputRelay
from specdecode.serve.replies import failed, usage
from specdecode.serve.requests import ChatMessage, ChatRequest, CompletionRequest, SamplingFields, check_fields, joined
from specdecode.serve.responses import ResponseEvents, ResponseShape, ResponsesRequest
from specdecode.serve.structured import FieldError, grammar_of
from specdecode.serve.tools import ToolPlan, check_schemas, message_of, plan_tools, render_messages

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 1.0  # how often a waiting request checks that its client is still there
CANCEL_GRACE_S = 10.0  # a cancel the engine has not confirmed by then: its thread is taken to be stuck


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

    def budget(self, body: SamplingFields, prompt_len: int) -> int:
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

    def encode_chat(self, messages: list[ChatMessage], tools: ToolPlan | None = None) -> list[int]:
        template = self.tokenizer.chat_template
        if not template:
            raise APIError(400, f"model {self.name!r} has no chat template; use /v1/completions", "messages")
        rendered, variables = render_messages(messages, tools, template)
        try:
            return self.tokenizer.encode_prompt(self.tokenizer.apply_chat_template(rendered, **variables))
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), "messages") from None

    async def start(self, ids: list[int], body: SamplingFields, tools: ToolPlan | None = None,
                    choice: int = 0) -> Handle:
        """Submits the request (its choice ``choice``: a seed asked for is the first choice's, ``seed + choice`` the
        others') to the engine loop; a full queue is a 429, a refused request a 400. ``tools``' grammar constrains the
        reply (with ``response_format`` also asking for one: a 400)."""
        if not self.accepting or not self.loop.alive:
            raise APIError(503, "the server is shutting down", kind="service_unavailable")
        running = asyncio.get_running_loop()
        if self._relay is None or self._relay.loop is not running:  # made here: it needs the running loop
            self._relay = OutputRelay(running)
        handle = Handle(self._relay, body.stream)
        prediction = joined(body.prediction.content) if body.prediction is not None else None
        try:
            structured = grammar_of(body.response_format, body.structured_outputs)
        except FieldError as exc:
            raise APIError(400, str(exc), exc.param) from None
        grammar, grammar_field = structured if structured is not None else (None, None)
        if tools is not None:
            if grammar is not None:
                raise APIError(400, f"{grammar_field} cannot be combined with tools unless tool_choice is none",
                               grammar_field)
            grammar, grammar_field = tools.grammar, "tools"
        if grammar is not None:  # compiled here, so that a large schema does not hold up the engine's thread
            try:
                await asyncio.to_thread(lambda: self.engine.grammar_compiler().compile(grammar))
            except GrammarError as exc:
                raise APIError(400, str(exc), grammar_field) from None
        sampling = body.sampling(self.engine.target.config.vocab_size)
        if choice and sampling.seed is not None:
            sampling = replace(sampling, seed=sampling.seed + choice)
        future = self.loop.submit(handle.on_output, prompt=ids, sampling=sampling,
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

    async def outputs(self, handle: Handle, request: Request) -> AsyncIterator[Output]:
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

    async def _watch(self, handle: Handle, request: Request) -> None:
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

    async def respond(self, request: Request, body: SamplingFields, ids: list[int], chat: bool,
                      tools: ToolPlan | None = None) -> Response:
        """The answer to a completion (``chat`` false) or chat request: its ``n`` choices started (a refused one
        cancels those before it), then answered together (``answers.py``); with ``tools``, read for tool calls."""
        handles: list[Handle] = []
        try:
            for choice in range(body.n):
                handles.append(await self.start(ids, body, tools, choice))
        except APIError:
            for handle in handles:
                self.loop.cancel(handle.seq)
            raise
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return await answer(self, request, handles, chat, body.stream, include_usage, tools)

    async def collect(self, request: Request, handle: Handle) -> tuple[str, str, list | None] | None:
        """A whole request's text, finish reason and log-probabilities (if asked); None when its client has gone.

        Raises:
            APIError: the generation failed (500) or ran past the deadline (504).
        """
        async with contextlib.aclosing(self.outputs(handle, request)) as outputs:
            last = [out async for out in outputs]
        seq = handle.seq
        finish = last[-1].finish_reason  # the engine's, or the watcher's when the engine stopped
        if finish == "error":
            raise failed(seq)
        if finish == "cancelled":
            if handle.timed_out:
                raise self.deadline_error()
            return None
        logprobs = [*handle.logprobs, *(lp for out in last for lp in out.logprobs or [])] \
            if seq.request.logprobs is not None else None
        return "".join(handle.texts + [out.text for out in last]), finish, logprobs

    async def prepare_chat(self, body: ChatRequest) -> tuple[list[int], ToolPlan | None]:
        """A chat request's prompt ids and its tools' plan (each tool's schema compiled off the event loop, so that
        a bad one is a 400 naming it)."""
        check_fields(body)
        self.check_model(body.model)
        tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.tokenizer.chat_template,
                           lambda text: self.engine.grammar_compiler().special_id(text))
        if tools is not None:
            await asyncio.to_thread(check_schemas, body.tools, self.engine.grammar_compiler().compile)
        return self.encode_chat(body.messages, tools), tools

def _served(request: Request) -> ServedModel:
    return request.app.state.served


async def completions(request: Request, body: CompletionRequest) -> Response:
    served = _served(request)
    check_fields(body)
    served.check_model(body.model)
    return await served.respond(request, body, served.encode_prompt(body.prompt), chat=False)


async def chat_completions(request: Request, body: ChatRequest) -> Response:
    served = _served(request)
    ids, tools = await served.prepare_chat(body)
    return await served.respond(request, body, ids, chat=True, tools=tools)


async def responses(request: Request, body: ResponsesRequest) -> Response:
    served = _served(request)
    refused = check_extra_fields(body.model_extra or {}, RESPONSES_REFUSED)
    if refused is not None:
        raise APIError(400, refused[1], refused[0])
    chat = body.as_chat()
    try:
        ids, tools = await served.prepare_chat(chat)
    except APIError as exc:  # the conversation's errors name its messages: here they are the input's items
        if exc.param is not None and exc.param.startswith("messages"):
            exc.param = "input"
        raise
    handle = await served.start(ids, chat, tools)
    shape = ResponseShape(body, served.name)
    if not body.stream:
        collected = await served.collect(request, handle)
        if collected is None:
            return Response(status_code=499)
        text, finish, _ = collected
        message, _ = message_of(text, tools, cut=finish == "length")
        return JSONResponse(shape.whole(message, usage(handle.seq), finish))
    return StreamingResponse(response_events(served, request, handle, ResponseEvents(shape), tools),
                             media_type="text/event-stream", headers=SSE_HEADERS)


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
                **error_responses(400, 401, 413, 429, 500, 503, 504)}  # 500: a failed step ends the requests it served
    app.add_api_route("/v1/completions", completions, methods=["POST"], responses=generate)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], responses=generate)
    app.add_api_route("/v1/responses", responses, methods=["POST"], responses=generate)
    app.add_api_route("/v1/models", models, methods=["GET"], responses=error_responses(401))
    app.add_api_route("/health", health, methods=["GET"], responses={503: {"description": "the engine stopped"}})
    app.add_api_route("/metrics", metrics_endpoint, methods=["GET"], responses=error_responses(401),
                      response_class=PlainTextResponse)  # Prometheus' text format
    return app
