"""Tool calling on ``/v1/chat/completions``: the request fields (``tools``, ``tool_choice``,
``parallel_tool_calls``, assistant ``tool_calls`` and ``tool`` messages in the history), the conversation rendered
with its tools, and the reply read back as OpenAI's ``message.tool_calls`` or streamed ``delta.tool_calls``.

The tools go to the chat template when it renders them (Qwen2.5's, Llama 3's, ...); a template that knows no tools
gets them in a system message that asks for the Hermes form. ``required`` and a named function constrain the reply
to calls by the tools' schemas; ``auto`` uses a lazy grammar (free text, constrained from the model's first
opener); ``none`` leaves the tools out. The formats and grammars are ``tool_calls/``'s; this module maps them to
HTTP and does not run requests (``app.py``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from pydantic import BaseModel, Field

from specdecode.grammar import Grammar, GrammarError
from specdecode.serve.errors import APIError
from specdecode.tool_calls.formats import (Call, CallFormat, Function, Parsed, arguments_value, format_for,
                                           template_knows_tools)
from specdecode.tool_calls.grammar import call_grammar
from specdecode.tool_calls.stream import CallStream, Delta

NAME_PATTERN = r"^[a-zA-Z0-9_.-]{1,64}$"  # OpenAI's function names


class FunctionSpec(BaseModel):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    """One entry of ``tools``: a function tool (the only kind served)."""

    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    name: str
    arguments: str


class ToolCallSpec(BaseModel):
    """An assistant message's past call, as the client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """How one request calls its tools: the family's format, the functions offered, the grammar that constrains
    the reply while it is written."""

    fmt: CallFormat
    functions: tuple[Function, ...]
    grammar: Grammar


def plan_tools(tools: list[ToolSpec] | None, choice: ToolChoice | None, parallel: bool | None,
               template: str | None, special_id: Callable[[str], int | None]) -> ToolPlan | None:
    """The plan for a request's tools, or None when the reply is plain text (no tools, or ``tool_choice`` none).
    ``special_id`` names the tokenizer's special tokens (``GrammarCompiler.special_id``).

    Raises:
        APIError: a choice without tools, a named function that is not among them, or a duplicate name (400).
    """
    functions = tuple(Function(t.function.name, t.function.parameters or {"type": "object", "properties": {}},
                               t.function.description, bool(t.function.strict)) for t in tools or [])
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise APIError(400, f"tools: function names must be unique (got {names})", "tools")
    if not functions:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    fmt = format_for(template)
    parallel = parallel is not False
    if isinstance(choice, NamedToolChoice):
        chosen = [f for f in functions if f.name == choice.function.name]
        if not chosen:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                                f"({', '.join(names)})", "tool_choice")
        return ToolPlan(fmt, functions, _grammar(fmt, chosen, False, False, special_id))
    lazy = choice in (None, "auto")
    return ToolPlan(fmt, functions, _grammar(fmt, functions, parallel, lazy, special_id))


def _grammar(fmt: CallFormat, functions: Sequence[Function], parallel: bool, lazy: bool,
             special_id: Callable[[str], int | None]) -> Grammar:
    try:
        return call_grammar(fmt, functions, parallel, lazy, special_id)
    except GrammarError as exc:
        raise APIError(400, str(exc), "tools") from None


def check_schemas(tools: list[ToolSpec] | None, compile_grammar) -> None:
    """A 400 naming ``tools[i].function.parameters`` for a schema that does not compile (``compile_grammar``
    compiles one :class:`Grammar`); run off the event loop."""
    for i, tool in enumerate(tools or []):
        try:
            compile_grammar(Grammar.json_schema(tool.function.parameters or {"type": "object"},
                                                strict=bool(tool.function.strict)))
        except GrammarError as exc:
            raise APIError(400, f"tools[{i}].function.parameters: {exc}", f"tools[{i}].function.parameters") from None


def render_messages(messages: list[Any], plan: ToolPlan | None, template: str | None) -> tuple[list[dict], dict]:
    """The conversation as a chat template takes it, and the template's extra variables (``tools``).

    Assistant ``tool_calls`` and ``tool`` results go to a template that knows tools as they are; otherwise the calls
    are written in the Hermes form and each run of results becomes one user turn of ``<tool_response>`` blocks.

    Raises:
        APIError: a ``tool`` message whose ``tool_call_id`` no earlier assistant call has (400 naming it).
    """
    native = template_knows_tools(template)
    fmt = plan.fmt if plan is not None else format_for(template)
    called: set[str] = set()
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = "" if m.content is None else _joined(m.content)
        if m.role == "assistant" and m.tool_calls:
            called.update(c.id for c in m.tool_calls)
            if native:
                calls = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": arguments_value(c.function.arguments)}} for c in m.tool_calls]
                out.append({"role": "assistant", "content": content, "tool_calls": calls})
            else:
                written = fmt.write([Call(c.function.name, c.function.arguments) for c in m.tool_calls])
                out.append({"role": "assistant", "content": (content + "\n" if content else "") + written})
        elif m.role == "tool":
            if m.tool_call_id not in called:
                raise APIError(400, f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no earlier assistant tool "
                                    "call", f"messages[{i}].tool_call_id")
            if native:
                out.append({"role": "tool", "content": content, "tool_call_id": m.tool_call_id})
            else:
                block = f"<tool_response>\n{content}\n</tool_response>"
                if messages[i - 1].role == "tool":  # a run of results: one user turn (its first opened it)
                    out[-1]["content"] += "\n" + block
                else:
                    out.append({"role": "user", "content": block})
        else:
            out.append({"role": m.role, "content": content})
    if plan is None:
        return out, {}
    if native:
        return out, {"tools": [f.as_openai() for f in plan.functions]}
    return _with_system(out, _tools_prompt(plan)), {}


def _joined(content: Any) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _tools_prompt(plan: ToolPlan) -> str:
    listed = "\n".join(json.dumps(f.as_openai(), ensure_ascii=False) for f in plan.functions)
    return ("You can call these functions (JSON signatures, one per line):\n<tools>\n" + listed + "\n</tools>\n\n"
            "To call one, write its name and a JSON object of arguments inside <tool_call></tool_call> tags:\n"
            '<tool_call>\n{"name": "function name", "arguments": {...}}\n</tool_call>')


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_of(text: str, plan: ToolPlan | None, cut: bool = False) -> tuple[dict[str, Any], bool]:
    """The reply's ``message`` and whether it called tools. A reply ``cut`` by its token budget keeps the calls it
    closed before the cut."""
    parsed: Parsed | None = plan.fmt.parse(text) if plan is not None else None
    if parsed is None and cut and plan is not None and plan.fmt.closer and plan.fmt.closer in text:
        parsed = plan.fmt.parse(text[:text.rindex(plan.fmt.closer) + len(plan.fmt.closer)])
    if parsed is not None and not {c.name for c in parsed.calls} <= {f.name for f in plan.functions}:
        parsed = None  # a call to no tool of the request's: the reply is text
    if parsed is None:
        return {"role": "assistant", "content": text}, False
    calls = [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in parsed.calls]
    return {"role": "assistant", "content": parsed.content, "tool_calls": calls}, True


class StreamedCalls:
    """Turns a streamed reply's text into chat chunk ``delta`` objects: content, or ``tool_calls`` entries with
    index, id, type and name first and argument fragments after."""

    def __init__(self, plan: ToolPlan) -> None:
        self._reader = CallStream(plan.fmt)
        self._ids: dict[int, str] = {}

    @property
    def called(self) -> bool:
        return self._reader.calls > 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self._reader.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(self._reader.finish())

    def _deltas(self, pieces: list[Delta]) -> list[dict[str, Any]]:
        out = []
        for piece in pieces:
            if piece.index < 0:
                out.append({"content": piece.content})
            elif piece.name is not None:
                self._ids[piece.index] = call_id()
                out.append({"tool_calls": [{"index": piece.index, "id": self._ids[piece.index], "type": "function",
                                            "function": {"name": piece.name, "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": piece.index, "function": {"arguments": piece.arguments}}]})
        return out
