"""OpenAI's Responses API (``POST /v1/responses``), stateless: the request's ``input`` (a string, or message,
``function_call`` and ``function_call_output`` items) and ``instructions`` become a chat conversation, served as a
chat completion is (same tools, grammars and speculation), and the reply comes back as output items — a
``message`` with ``output_text``, and one ``function_call`` per call — whole, or streamed as typed events
(``response.created``, ``response.output_text.delta``, ``response.function_call_arguments.delta``,
``response.completed``, ...).

Nothing is stored: ``store: true`` and ``previous_response_id`` are a 400 naming the field. It does not run
requests (``app.py``) or read tool calls (``tools.py``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specdecode.serve.errors import APIError
from specdecode.serve.fields import first_unencodable
from specdecode.serve.requests import ChatMessage, ChatRequest, ContentPart
from specdecode.serve.structured import JsonSchemaFormat, ResponseFormat
from specdecode.serve.tools import CalledFunction, FunctionName, FunctionSpec, NamedToolChoice, ToolCallSpec, ToolSpec


class TextPart(BaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class _FunctionType(BaseModel):
    type: Literal["function"]


class FunctionTool(FunctionSpec, _FunctionType):
    """A function tool in the Responses API's flat form: the chat API's function with its ``type`` beside it (checked
    first, so that another kind of tool is refused by its type)."""


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``; fields it does not declare go to ``fields.check_extra_fields``."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[MessageItem | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _typed_items(cls, data: Any) -> Any:
        """A message item may leave out its ``type`` (the SDKs send ``{"role", "content"}``)."""
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            data = {**data, "input": [{"type": "message", **item} if isinstance(item, dict) and "type" not in item
                                      else item for item in data["input"]]}
        return data

    def as_chat(self) -> ChatRequest:
        """The chat completion request this asks for.

        Raises:
            APIError: ``store`` true or a ``previous_response_id`` (nothing is kept here), no message at all, text
                that is not Unicode, or an item or tool the chat request refuses (a 400 naming the field).
        """
        bad = first_unencodable(self.model_dump(include={"input", "instructions", "tools", "text"}, by_alias=True,
                                                exclude_none=True))
        if bad is not None:
            raise APIError(400, f"{bad}: the text is not valid Unicode (a lone surrogate)", bad)
        try:
            return self._as_chat()
        except ValidationError as exc:
            error = exc.errors()[0]
            loc = [str(part) for part in error["loc"]]
            param = {"messages": "input", "tools": "tools"}.get(loc[0], loc[0]) if loc else "input"
            raise APIError(400, f"{param}: {error['msg']}", param) from None

    def _as_chat(self) -> ChatRequest:
        if self.previous_response_id is not None:
            raise APIError(400, "previous_response_id: this server keeps no responses; send the whole conversation "
                                "as input", "previous_response_id")
        if self.store:
            raise APIError(400, "store: this server keeps no responses (send store: false or leave it out)", "store")
        fmt = self.text.format if self.text is not None else None
        response_format = None
        if fmt is not None and fmt.type != "text":
            schema = JsonSchemaFormat(name=fmt.name or "output", schema=fmt.schema_ or {}, strict=fmt.strict) \
                if fmt.type == "json_schema" else None
            response_format = ResponseFormat(type=fmt.type, json_schema=schema)
        tools = [ToolSpec(type="function", function=FunctionSpec(**t.model_dump(exclude={"type"})))
                 for t in self.tools or []] or None
        choice = NamedToolChoice(type="function", function=FunctionName(name=self.tool_choice.name)) \
            if isinstance(self.tool_choice, NamedFunction) else self.tool_choice
        return ChatRequest(model=self.model, messages=self._messages(), tools=tools, tool_choice=choice,
                           parallel_tool_calls=self.parallel_tool_calls, max_tokens=self.max_output_tokens,
                           temperature=self.temperature, top_p=self.top_p, response_format=response_format,
                           stream=self.stream)

    def _messages(self) -> list[ChatMessage]:
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                messages.append(ChatMessage(role=item.role, content=_text(item.content)))
            elif isinstance(item, FunctionCallItem):
                call = ToolCallSpec(id=item.call_id, function=CalledFunction(name=item.name, arguments=item.arguments))
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant":  # calls after the assistant's text: one turn
                    last.tool_calls = [*(last.tool_calls or []), call]
                else:
                    messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            else:
                messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=_text(item.output)))
        if not messages:
            raise APIError(400, "input holds no message", "input")
        return messages


def _text(content: str | list[TextPart]) -> str | list[ContentPart]:
    return content if isinstance(content, str) else [ContentPart(type="text", text=p.text) for p in content]


class ResponseShape:
    """One response's bodies: the whole ``response`` object at each stage, its output items, and the typed
    events of its stream (each numbered)."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.body, self.model = body, model
        self.output: list[dict[str, Any]] = []
        self._seq = 0

    def response(self, status: str, usage: dict[str, Any] | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.output, "instructions": b.instructions,
                "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
                "tool_choice": b.tool_choice.model_dump() if isinstance(b.tool_choice, BaseModel) else
                (b.tool_choice or "auto"), "parallel_tool_calls": b.parallel_tool_calls is not False,
                "temperature": b.temperature, "top_p": b.top_p, "max_output_tokens": b.max_output_tokens,
                "text": {"format": b.text.format.model_dump(by_alias=True, exclude_none=True)
                         if b.text is not None and b.text.format is not None else {"type": "text"}},
                "store": False, "metadata": {}, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None, "usage": usage}

    @staticmethod
    def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
        return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
                "total_tokens": chat_usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}, "speculation": chat_usage["speculation"]}

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{call_id.removeprefix('call_')}", "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}

    def whole(self, message: dict[str, Any], chat_usage: dict[str, Any], finish: str) -> dict[str, Any]:
        """The finished response from a chat reply's ``message`` (its content and tool calls)."""
        if message.get("content"):
            self.output.append(self.message_item(message["content"]))
        for call in message.get("tool_calls") or []:
            self.output.append(self.call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
        return self.final(chat_usage, finish)

    def final(self, chat_usage: dict[str, Any], finish: str) -> dict[str, Any]:
        cut = finish == "length"
        return self.response("incomplete" if cut else "completed", self.usage(chat_usage),
                             "max_output_tokens" if cut else None)

    def event(self, kind: str, **fields: Any) -> str:
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self._seq - 1, **fields})}\n\n"


class ResponseEvents:
    """The typed events of one streamed response, from the chat deltas of its reply (``tools.StreamedCalls`` or
    plain content)."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self._text: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # call index -> its open item

    def start(self) -> Iterator[str]:
        yield self.shape.event("response.created", response=self.shape.response("in_progress"))
        yield self.shape.event("response.in_progress", response=self.shape.response("in_progress"))

    def delta(self, delta: dict[str, Any]) -> Iterator[str]:
        s = self.shape
        if delta.get("content"):
            if self._text is None:
                self._text = s.message_item("", "in_progress")
                s.output.append(self._text)
                yield s.event("response.output_item.added", output_index=len(s.output) - 1, item=self._text)
                yield s.event("response.content_part.added", item_id=self._text["id"], output_index=len(s.output) - 1,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            self._text["content"][0]["text"] += delta["content"]
            yield s.event("response.output_text.delta", item_id=self._text["id"], output_index=self._index(self._text),
                          content_index=0, delta=delta["content"], logprobs=[])
        for call in delta.get("tool_calls") or []:
            fn = call["function"]
            if "id" in call:  # a new call
                yield from self._close_text()
                item = s.call_item(call["id"], fn["name"], "", "in_progress")
                self._calls[call["index"]] = item
                s.output.append(item)
                yield s.event("response.output_item.added", output_index=len(s.output) - 1, item=item)
            item = self._calls[call["index"]]
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                yield s.event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=self._index(item), delta=fn["arguments"])

    def finish(self, chat_usage: dict[str, Any], finish: str) -> Iterator[str]:
        s = self.shape
        yield from self._close_text()
        for item in self._calls.values():
            item["status"] = "completed"
            yield s.event("response.function_call_arguments.done", item_id=item["id"], output_index=self._index(item),
                          name=item["name"], arguments=item["arguments"])
            yield s.event("response.output_item.done", output_index=self._index(item), item=item)
        final = s.final(chat_usage, finish)
        yield s.event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)

    def _close_text(self) -> Iterator[str]:
        if self._text is None or self._text["status"] == "completed":
            return
        s, item = self.shape, self._text
        item["status"] = "completed"
        part = item["content"][0]
        at = self._index(item)
        yield s.event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                      text=part["text"], logprobs=[])
        yield s.event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0, part=part)
        yield s.event("response.output_item.done", output_index=at, item=item)

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, o in enumerate(self.shape.output) if o is item)
