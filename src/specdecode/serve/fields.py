"""Which request fields the server honours, refuses or ignores, and text it cannot encode.

OpenAI's request fields that change what a completion is but are not implemented here (``best_of``, the legacy
``functions``, tools on ``/v1/completions``, ...) are refused with a 400 naming the field whenever they ask for
something other than their default;
fields that do not change the completion (``user``, ``metadata``, ``store``, ...) are accepted and ignored;
any other unknown field is ignored too and logged once per name, since a client library may send fields
newer than this server. Text fields holding a lone surrogate (``"\\udfff"``, valid
JSON but not Unicode) are a 400 naming the field.

It does not parse requests (``requests.py``'s models do) nor check their values' ranges.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("specdecode.serve")

# Field -> the values that ask for nothing (the field's default or an explicit "off"); anything else is refused.
REFUSED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"),  # reach here from completions only
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "top_logprobs": (None, 0),  # reaches here from completions only, whose count is `logprobs`
    "audio": (None,), "modalities": (None, ["text"]),
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "web_search_options": (None,),
    # vLLM's sampling extensions (we take its top_k, min_p and repetition_penalty): refused unless neutral.
    "min_tokens": (None, 0), "ignore_eos": (None, False),
    "stop_token_ids": (None, []), "skip_special_tokens": (None, True), "include_stop_str_in_output": (None, False),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
}
# The Responses API's fields for what this stateless server does not do (stored state, background runs, prompt
# templates, other outputs), refused unless they ask for nothing; its sampling and tool fields are declared.
RESPONSES_REFUSED: dict[str, tuple[Any, ...]] = {
    **REFUSED, "conversation": (None,), "background": (None, False), "prompt": (None,), "include": (None, []),
    "max_tool_calls": (None,), "top_logprobs": (None, 0), "truncation": (None, "disabled"),
}
# Accepted and ignored: they do not change the completion.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                     "reasoning_effort", "verbosity"})
MAX_LOGGED = 64  # unknown names logged, then one line saying that no more will be

_logged: set[str] = set()


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    return any(value == o and type(value) is type(o) for o in off)  # True is not 1 here


def check_extra_fields(extra: dict[str, Any], refused: dict[str, tuple[Any, ...]] = REFUSED) -> tuple[str, str] | None:
    """The first field of ``extra`` (fields the request models do not declare) that asks for what this server
    does not do (``refused``: field -> the values that ask for nothing), as (field, message); unknown fields are
    logged once per name and ignored."""
    for name, value in extra.items():
        if name in refused:
            if not _is_off(value, refused[name]):
                return name, f"{name} is not supported by this server (got {_short(value)})"
        elif name not in IGNORED and name not in _logged and len(_logged) <= MAX_LOGGED:
            _logged.add(name)
            if len(_logged) > MAX_LOGGED:
                log.warning("ignoring further unknown request fields without logging them")
            else:
                log.warning("ignoring the unknown request field %s (logged once)", _short(name))
    return None


TEXT_FIELDS = ("prompt", "messages", "stop", "prediction", "response_format", "structured_outputs", "tools")


def unencodable_text(body: dict[str, Any]) -> str | None:
    """The dotted path of the first text in what reaches the tokenizer or the grammar compiler (TEXT_FIELDS:
    ``messages``' contents, a schema's strings, ...) that is not valid Unicode, or None; token-id prompts are not
    walked."""
    for name in TEXT_FIELDS:
        value = body.get(name)
        if name == "prompt" and isinstance(value, list) and not all(isinstance(v, str) for v in value):
            continue  # token ids
        found = first_unencodable(value, name) if value is not None else None
        if found is not None:
            return found
    return None


def first_unencodable(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string in ``value`` (nested dicts and lists) that is not valid Unicode
    (a lone surrogate), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = first_unencodable(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
