"""Prompt files: the JSONL format shared by ``specdecode bench --prompts`` and ``train-head --prompts``,
its validation, and rendering a prompt to the token ids a model is fed.

A prompt file is JSONL, one object per line: ``{"id", "category", "prompt"}`` or ``{"id", "category",
"messages"}`` (a chat: ``[{"role": "system"|"user"|"assistant", "content": "..."}, ...]``), with an
optional ``"prediction"``: a non-empty string, the text the answer is expected to be mostly made of
(OpenAI's "Predicted Outputs": for an edit, the original text) and an optional ``"schema"``: a JSON schema the
answer must follow (``bench`` decodes under it and checks the answers). Blank lines are ignored; other keys are
ignored too. Every problem is reported with its line number, and a file with any problem is rejected as
a whole. This module does not run models nor hold any prompt set (the benchmark's suites are
``bench/prompts.py``'s, the head-training set ``heads/data.py``'s).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

ROLES = ("system", "user", "assistant")
_MAX_ERRORS = 20


class PromptFileError(ValueError):
    """A prompt file that cannot be used; the message lists every bad line as ``FILE:LINE: reason``."""


@dataclass(frozen=True)
class Prompt:
    """One prompt of a prompt file.

    Args:
        id: unique within its file.
        category: free text (the benchmark's suites use ``bench.prompts.CATEGORIES``).
        prompt: plain text, or None when ``messages`` is given.
        messages: a chat, or None when ``prompt`` is given.
        prediction: text the answer is expected to be mostly made of (an edit's original), or None.
        schema: a JSON schema the answer must follow (as JSON text), or None.
    """

    id: str
    category: str
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    prediction: str | None = None
    schema: str | None = None


def _check_line(obj: Any) -> str | Prompt:
    """The prompt a parsed line describes, or the reason it is not one."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    for key in ("id", "category"):
        if key not in obj:
            return f"missing key {key!r}"
    pid, category = obj["id"], obj["category"]
    if isinstance(pid, bool) or not isinstance(pid, (str, int)) or str(pid).strip() == "":
        return "'id' must be a non-empty string (or an integer)"
    if not isinstance(category, str) or not category.strip():
        return "'category' must be a non-empty string"
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        return "expected exactly one of 'prompt' or 'messages'"
    prediction = obj.get("prediction")
    if "prediction" in obj and (not isinstance(prediction, str) or not prediction.strip()):
        return "'prediction' must be a non-empty string"
    if "schema" in obj and not isinstance(obj["schema"], dict):
        return "'schema' must be a JSON schema (an object)"
    schema = json.dumps(obj["schema"]) if "schema" in obj else None
    if has_prompt:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            return "'prompt' must be a non-empty string"
        return Prompt(str(pid), category.strip(), prompt=obj["prompt"], prediction=prediction, schema=schema)
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {\"role\", \"content\"} objects"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"messages[{i}] must be an object with string 'role' and 'content'"
        if m["role"] not in ROLES:
            return f"messages[{i}].role is {m['role']!r}; expected one of {ROLES}"
    if messages[-1]["role"] != "user":
        return "the last message must have role 'user' (the model answers it)"
    clean = tuple({"role": m["role"], "content": m["content"]} for m in messages)
    return Prompt(str(pid), category.strip(), messages=clean, prediction=prediction, schema=schema)


def parse_prompts(lines: Iterable[str], source: str = "<prompts>") -> list[Prompt]:
    """Validates JSONL lines into prompts.

    Args:
        lines: the file's lines.
        source: the file name used in error messages.

    Raises:
        PromptFileError: any malformed line, a duplicate id, or no prompt at all.
    """
    prompts: list[Prompt] = []
    errors: list[str] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append(f"{source}:{number}: not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        checked = _check_line(obj)
        if isinstance(checked, str):
            errors.append(f"{source}:{number}: {checked}")
        elif checked.id in first_line:
            errors.append(f"{source}:{number}: duplicate id {checked.id!r} (first on line {first_line[checked.id]})")
        else:
            first_line[checked.id] = number
            prompts.append(checked)
    if errors:
        more = f"\n... and {len(errors) - _MAX_ERRORS} more" if len(errors) > _MAX_ERRORS else ""
        raise PromptFileError(f"{len(errors)} bad line(s) in {source}; nothing was run:\n"
                              + "\n".join(errors[:_MAX_ERRORS]) + more)
    if not prompts:
        raise PromptFileError(f"{source}: no prompts (the file is empty)")
    return prompts


def load_prompts(path: str | Path) -> list[Prompt]:
    """Reads and validates a user's JSONL prompt file.

    Raises:
        PromptFileError: see :func:`parse_prompts`; also a file that is not UTF-8.
        OSError: the file cannot be read.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return parse_prompts(text.splitlines(), str(path))


def render(prompt: Prompt, tokenizer, chat: bool = True) -> list[int]:
    """The token ids a prompt is fed to every method as.

    With a chat template, ``messages`` are rendered with it (generation prompt appended) and so, when
    ``chat`` is true (the default), is a plain ``prompt``, as a single user message. Without a chat
    template (or with ``chat`` false for plain prompts) a plain prompt is fed as is (with BOS when the
    tokenizer adds one), and ``messages`` become ``"role: content"`` lines followed by ``"assistant:"``.

    Args:
        prompt: the prompt.
        tokenizer: a ``specdecode.models.tokenizer.Tokenizer``.
        chat: wrap plain prompts in the chat template when there is one.
    """
    template = getattr(tokenizer, "chat_template", None)
    if prompt.messages is not None:
        if template:
            return tokenizer.encode_prompt(tokenizer.apply_chat_template(list(prompt.messages)))
        text = "".join(f"{m['role']}: {m['content']}\n" for m in prompt.messages) + "assistant:"
        return tokenizer.encode_prompt(text)
    if chat and template:
        return tokenizer.encode_prompt(tokenizer.apply_chat_template([{"role": "user", "content": prompt.prompt}]))
    return tokenizer.encode_prompt(prompt.prompt)
