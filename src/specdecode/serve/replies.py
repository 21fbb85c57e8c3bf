"""Answers in OpenAI's shapes: a whole completion or chat completion, the chunks of a stream (server-sent
events), log-probabilities (chat's ``content`` list, a completion's parallel lists) and ``usage`` with the
request's speculation figures.

It does not run requests or decide what is refused (``app.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specdecode.batch.sequence import SequenceState
from specdecode.logprobs import TokenLogprob
from specdecode.serve.errors import APIError

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


def usage(seq: SequenceState) -> dict[str, Any]:
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


def failed(seq: SequenceState) -> APIError:
    return APIError(500, f"generation failed: {seq.error}", kind="server_error")


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@dataclass
class Reply:
    """One answer's bodies in OpenAI's shapes: ``base`` is its id, creation time and model."""

    chat: bool
    base: dict[str, Any]
    tokenizer: Any = None  # names the tokens of log-probabilities
    index: int = 0  # the choice's index (n > 1)
    text_offset: int = 0  # a completion's characters before the next log-probabilities' first token

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def whole(self, content: str, finish: str, usage: dict[str, Any], logprobs: list[TokenLogprob] | None = None,
              message: dict[str, Any] | None = None) -> dict[str, Any]:
        """The whole answer; a chat's ``message`` (with its tool calls) where it is more than ``content``."""
        choice = ({"index": self.index, "message": message or {"role": "assistant", "content": content}}
                  if self.chat else {"index": self.index, "text": content})
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
            choice = {"index": self.index, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish}
        else:
            choice = {"index": self.index, "text": text or "", "logprobs": self.logprobs(logprobs),
                      "finish_reason": finish}
        return {**self.base, "object": self.chunk_kind, "choices": [choice]}

    def delta_chunk(self, delta: dict[str, Any]) -> dict[str, Any]:
        """A chat chunk carrying ``delta`` as it is (content or ``tool_calls`` entries)."""
        return {**self.base, "object": self.chunk_kind,
                "choices": [{"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}]}

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
