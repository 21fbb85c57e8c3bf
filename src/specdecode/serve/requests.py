"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (pydantic models in OpenAI's shapes, with
vLLM's extensions) and the checks FastAPI's validation does not make: fields this server does not implement and
text that is not Unicode (a 400 naming the field).

It does not run requests (``app.py``) or turn structured-output fields into grammars (``structured.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specdecode.sampling import Penalties, SamplingParams
from specdecode.serve.errors import APIError
from specdecode.serve.fields import TEXT_FIELDS, check_extra_fields, unencodable_text
from specdecode.serve.structured import ResponseFormat, StructuredOutputs
from specdecode.serve.tools import ToolCallSpec, ToolChoice, ToolSpec


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


class SamplingFields(BaseModel):
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
    n: int = Field(1, ge=1, le=8)  # choices, each its own sequence
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)  # vLLM's extension (which takes any > 0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> -100..100
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's extension
    prediction: PredictedOutput | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension: json, regex, choice

    def sampling(self, vocab_size: int) -> SamplingParams:
        """The engine's sampling settings; a ``logit_bias`` key that is not a token id of ``vocab_size``, or a bias
        outside -100..100, is a 400 naming the field."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
                raise APIError(400, f"logit_bias keys are token ids in 0..{vocab_size - 1} (got {key!r})", "logit_bias")
            if not -100.0 <= value <= 100.0:
                raise APIError(400, f"logit_bias values are in -100..100 (got {value} for {key})", "logit_bias")
            bias.append((int(key), float(value)))
        penalties = Penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty, tuple(bias))
        return SamplingParams(self.temperature, max(0, self.top_k), self.top_p, self.seed, self.min_p, penalties)

    def top_logprobs_asked(self) -> int | None:
        """Alternatives per token to report with log-probabilities; None = no log-probabilities."""
        raise NotImplementedError

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", "stop")
        return stops


class CompletionRequest(SamplingFields):
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
    tool_calls: list[ToolCallSpec] | None = None  # an assistant's past calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def top_logprobs_asked(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def check_fields(body: SamplingFields) -> None:
    """A 400 for a field this server does not implement, or for text that is not valid Unicode."""
    refused = check_extra_fields(body.model_extra or {})
    if refused is not None:
        raise APIError(400, refused[1], refused[0])
    bad = unencodable_text(body.model_dump(exclude_none=True, by_alias=True, include=set(TEXT_FIELDS)))
    if bad is not None:
        raise APIError(400, f"{bad}: the text is not valid Unicode (a lone surrogate)", bad)
