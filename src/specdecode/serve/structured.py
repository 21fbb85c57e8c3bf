"""The request fields that ask for structured output, as a grammar: OpenAI's ``response_format`` (``text``,
``json_object``, ``json_schema`` with ``strict``) and vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``json_object``), on both endpoints.

A field that asks for what is not done here (vLLM's ``grammar`` or ``structural_tag``, a second format) is a
400 naming it; a grammar that does not compile is refused when the engine compiles it (``grammar.py``), also
a 400 naming the field it came from. It does not mask or decode (``grammar.py``, ``batch/executor.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdecode.grammar import Grammar, GrammarError


class FieldError(ValueError):
    """A structured-output field that asks for something wrong; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(..., max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")  # (``schema`` is a BaseModel name)
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its fields (those this server implements)."""

    model_config = ConfigDict(extra="forbid")  # grammar, structural_tag, ...: a 400 naming them

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


def grammar_of(response_format: ResponseFormat | None,
               structured: StructuredOutputs | None) -> tuple[Grammar, str] | None:
    """The grammar a request asks for and the field it came from, or None for free text.

    Raises:
        FieldError: both fields ask for a format, a format is incomplete, or its schema/regex/choice is malformed.
    """
    asked = response_format is not None and response_format.type != "text"
    if asked and structured is not None:
        raise FieldError("structured_outputs", "give response_format or structured_outputs, not both")
    try:
        if asked:
            return _response_format(response_format), "response_format"
        if structured is not None:
            return _structured(structured), "structured_outputs"
    except GrammarError as exc:
        raise FieldError("structured_outputs" if structured is not None else "response_format", str(exc)) from None
    return None


def _response_format(fmt: ResponseFormat) -> Grammar:
    if fmt.type == "json_object":
        return Grammar.json_object()
    if fmt.json_schema is None:
        raise FieldError("response_format.json_schema", "response_format of type json_schema needs its json_schema")
    # strict: a keyword the compiler cannot enforce is refused; else it is left out (OpenAI's best effort).
    return Grammar.json_schema(fmt.json_schema.schema_, strict=bool(fmt.json_schema.strict))


def _structured(so: StructuredOutputs) -> Grammar:
    given = [name for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                      ("json_object", so.json_object or None)) if value is not None]
    if len(given) != 1:
        raise FieldError("structured_outputs", "structured_outputs takes exactly one of json, regex, choice or "
                         f"json_object (got {', '.join(given) or 'none'})")
    if so.json_ is not None:
        return Grammar.json_schema(so.json_)
    if so.regex is not None:
        return Grammar.regex(so.regex)
    if so.choice is not None:
        return Grammar.choice(so.choice)
    return Grammar.json_object()
