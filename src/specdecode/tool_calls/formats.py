"""How a model family writes tool calls as text, and reading them back.

A :class:`CallFormat` says what opens a call, what closes it, what separates parallel calls and under which key
the arguments go. Three families are known, told apart by the chat template's own text (:func:`format_for`):

- ``hermes`` (Qwen2.5, Qwen3, Hermes, and every template that knows no tools): ``<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>``, one block per call; a reply that is nothing but fenced JSON blocks of such
  objects (```` ```json ````), as Qwen2.5-Coder writes its calls, is read as calls too;
- ``llama3`` (Llama 3.1-3.3 JSON tool calling): the reply is ``{"name": ..., "parameters": {...}}``, calls
  separated by ``; ``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

It does not build grammars (``grammar.py``), stream (``stream.py``) or know HTTP fields (``serve/tools.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence


FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n?[ \t]*```", re.DOTALL)  # a fenced block's body


@dataclass(frozen=True)
class Function:
    """A tool the model may call: its name, JSON-schema ``parameters``, description and OpenAI's ``strict``."""

    name: str
    parameters: dict[str, Any]
    description: str | None = None
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        """``{"type": "function", "function": {...}}``, the form chat templates iterate over as ``tools``."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class Call:
    """One call the model wrote: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Parsed:
    """A reply read as tool calls: the text before the first call (None when only whitespace) and the calls."""

    content: str | None
    calls: tuple[Call, ...]


@dataclass(frozen=True)
class CallFormat:
    """One family's written form of tool calls.

    Args:
        family: ``hermes``, ``llama3`` or ``mistral``.
        opener: text that starts a call ("" for a reply that is the calls from its first character).
        closer: text that ends each call ("" when the format has none).
        separator: text between parallel calls.
        arguments_key: the JSON key of the arguments object (``arguments``; Llama 3's ``parameters``).
        as_list: the calls are one JSON list after the opener (Mistral), not one object per call.
        fenced: a reply made only of fenced JSON blocks of call objects is read as calls (not constrained: a
            grammar starts at the opener only).
    """

    family: str
    opener: str
    closer: str
    separator: str
    arguments_key: str = "arguments"
    as_list: bool = False
    fenced: bool = False

    def call_schema(self, functions: Sequence[Function]) -> dict[str, Any]:
        """The JSON schema of one call object to any of ``functions`` (the name first, then the arguments)."""
        options = [{"type": "object", "additionalProperties": False, "required": ["name", self.arguments_key],
                    "properties": {"name": {"const": f.name}, self.arguments_key: f.parameters or {"type": "object"}}}
                   for f in functions]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def write(self, calls: Sequence[Call]) -> str:
        """The text of ``calls`` as this family writes them (an assistant turn's calls in the history)."""
        objects = [{"name": c.name, self.arguments_key: arguments_value(c.arguments)} for c in calls]
        if self.as_list:
            return self.opener + json.dumps(objects, ensure_ascii=False)
        blocks = [self.opener + json.dumps(o, ensure_ascii=False) + self.closer for o in objects]
        return self.separator.join(blocks)

    def parse(self, text: str) -> Parsed | None:
        """``text`` read as content and calls; None when it holds no call or a call that is not well formed
        (the reply is then plain text)."""
        start = text.find(self.opener) if self.opener else (0 if text.lstrip().startswith("{") else -1)
        if start < 0:
            return self._fenced(text) if self.fenced else None
        content = text[:start] if start and text[:start].strip() else None
        body = text[start + len(self.opener):] if self.opener else text.lstrip()
        objects = self._objects(body)
        if not objects:
            return None
        calls = self._calls(objects)
        return Parsed(content, calls) if calls else None

    def _calls(self, objects: list[Any]) -> tuple[Call, ...]:
        """The calls of decoded call objects; none when one of them is not a call."""
        calls = []
        for obj in objects:
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or \
                    not isinstance(obj.get(self.arguments_key, {}), dict):
                return ()
            calls.append(Call(obj["name"], json.dumps(obj.get(self.arguments_key, {}), ensure_ascii=False)))
        return tuple(calls)

    def _fenced(self, text: str) -> Parsed | None:
        """A reply that is only fenced JSON blocks, each a call object or a list of them, read as calls."""
        blocks = FENCE.findall(text)
        if not blocks or FENCE.sub("", text).strip():
            return None
        objects: list[Any] = []
        for block in blocks:
            try:
                value = json.loads(block)
            except json.JSONDecodeError:
                return None
            objects += value if isinstance(value, list) else [value]
        calls = self._calls(objects)
        return Parsed(None, calls) if calls else None

    def _objects(self, body: str) -> list[Any] | None:
        """The call objects in ``body`` (what follows the first opener), or None when malformed."""
        decoder = json.JSONDecoder()
        if self.as_list:
            try:
                value, end = decoder.raw_decode(body.lstrip())
            except json.JSONDecodeError:
                return None
            return value if isinstance(value, list) and not body.lstrip()[end:].strip() else None
        objects, rest = [], body
        while True:
            rest = rest.lstrip()
            try:
                value, end = decoder.raw_decode(rest)
            except json.JSONDecodeError:
                return None
            objects.append(value)
            rest = rest[end:].lstrip()
            if self.closer:
                if not rest.startswith(self.closer.strip()):
                    return None
                rest = rest[len(self.closer.strip()):].lstrip()
            if not rest:
                return objects
            sep, opener = self.separator.strip(), self.opener.strip()
            if sep and rest.startswith(sep):
                rest = rest[len(sep):].lstrip()
            if opener:
                if not rest.startswith(opener):
                    return None
                rest = rest[len(opener):]


def arguments_value(arguments: str) -> Any:
    """Arguments' JSON text as a value (what templates and written calls take), or the text where it is not JSON."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # a client's own malformed history: rendered as it came


HERMES = CallFormat("hermes", opener="<tool_call>\n", closer="\n</tool_call>", separator="\n", fenced=True)
LLAMA3 = CallFormat("llama3", opener="", closer="", separator="; ", arguments_key="parameters")
MISTRAL = CallFormat("mistral", opener="[TOOL_CALLS]", closer="", separator="", as_list=True)
FORMATS = {f.family: f for f in (HERMES, LLAMA3, MISTRAL)}


def format_for(template: str | None) -> CallFormat:
    """The call format a chat template's model writes (Hermes' for a template that shows none)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    if "<|python_tag|>" in text or ("<|eom_id|>" in text and '"parameters"' in text):
        return LLAMA3
    return HERMES


def template_knows_tools(template: str | None) -> bool:
    """Whether the chat template renders a ``tools`` list itself (else the tools go in a system message)."""
    return template is not None and "tools" in template
