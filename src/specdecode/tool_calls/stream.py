"""A streamed reply read as it comes: content until the family's opener, then each call's name as soon as it is
written and its arguments in fragments, as OpenAI streams ``delta.tool_calls``.

Text that might be the start of an opener is held back until it is known not to be. A call is expected as
``{"name": "...", "<arguments key>": {...}}`` (the form the grammars write, name first); the fragments of its
arguments joined are exactly the arguments' JSON text. A format without an opener (Llama 3's bare JSON), with
one list of calls (Mistral), or a reply that starts with a fence (Qwen2.5-Coder's fenced calls) is read whole when
the reply ends. It does not decide what a finished reply holds
(``formats.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from specdecode.tool_calls.formats import CallFormat

FENCE_MARK = "```"
FENCED_OBJECT = re.compile(r"(?:json)?[ \t]*(?:\n\s*(?:\{.*)?)?\Z", re.DOTALL)  # after a fence: a JSON object's start


@dataclass(frozen=True)
class Delta:
    """A piece of a streamed reply: content text, or, for call ``index``, its name (once) or an argument fragment."""

    content: str = ""
    index: int = -1
    name: str | None = None
    arguments: str = ""


def _held(text: str, mark: str) -> int:
    """How many characters at the end of ``text`` could begin ``mark``."""
    for n in range(min(len(text), len(mark) - 1), 0, -1):
        if mark.startswith(text[-n:]):
            return n
    return 0


class CallStream:
    """Reads one streamed reply in ``fmt``: :meth:`feed` each new piece of text, :meth:`finish` at the end."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self._head = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + re.escape(fmt.arguments_key)
                                + r'"\s*:\s*')
        self._text = ""
        self._shown = 0  # characters of _text given out as content
        self._opened = False  # the first opener was seen
        self._region: int | None = None  # where the current call's JSON starts (None: between calls)
        self._after = 0  # where the text after the last closed call starts
        self._named = False
        self._sent = 0  # characters of the current call's arguments given out
        self.calls = 0  # calls given out (named)
        self._plain = False  # (a format without an opener) the reply is plainly text

    def feed(self, piece: str) -> list[Delta]:
        self._text += piece
        if not self.fmt.opener:  # a call only from the reply's first character
            start = self._text.lstrip()
            if not self._plain and start and not start.startswith("{"):
                self._plain = True
            return self._content(len(self._text)) if self._plain else []
        if self._fence_held():  # perhaps only fenced calls: read when the reply ends
            return []
        if not self._opened:
            found = self._text.find(self.fmt.opener, self._shown)
            if found < 0:
                return self._content(len(self._text) - _held(self._text, self.fmt.opener))
            self._opened = True
            out = self._content(found)
            self._shown = found  # what comes before a call is content only when it is more than whitespace
            if self.fmt.as_list:  # the list is read whole when the reply ends
                return out
            self._region = found + len(self.fmt.opener)
            return out + self._call_deltas()
        return [] if self.fmt.as_list else self._call_deltas()

    def _fence_held(self) -> bool:
        """Whether the reply so far may be fenced calls (a format that reads them; nothing shown yet): a fence
        that opens a JSON object, or the start of one. A fence of anything else streams as it comes."""
        if not self.fmt.fenced or self._opened or self._shown:
            return False
        start = self._text.lstrip()
        if not start.startswith(FENCE_MARK):
            return FENCE_MARK.startswith(start)
        rest = start[len(FENCE_MARK):]
        return "json".startswith(rest) or FENCED_OBJECT.match(rest) is not None

    def finish(self) -> list[Delta]:
        """What is left when the reply ends: held-back content, or the calls of a reply read whole."""
        if self._opened and not self.fmt.as_list:
            return []
        if self._opened or (not self.fmt.opener and not self._plain) or self._fence_held():
            parsed = self.fmt.parse(self._text)
            if parsed is not None:
                out = [Delta(content=parsed.content)] if parsed.content and not self._opened else []
                for i, call in enumerate(parsed.calls):
                    out += [Delta(index=i, name=call.name), Delta(index=i, arguments=call.arguments)]
                self.calls = len(parsed.calls)
                return out
        return self._content(len(self._text), whole=True)

    def _content(self, upto: int, whole: bool = False) -> list[Delta]:
        """Content up to ``upto``; held while it is only whitespace (which before a call is no content), unless the
        reply is ``whole``."""
        if upto <= self._shown or (not whole and not self._text[:upto].strip()):
            return []
        text, self._shown = self._text[self._shown:upto], upto
        return [Delta(content=text)]

    def _call_deltas(self) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if self._region is None:
                found = self._text.find(self.fmt.opener, self._after)
                if found < 0:
                    return out
                self._region = found + len(self.fmt.opener)
            head = self._head.match(self._text, self._region)
            if head is None:
                return out
            if not self._named:
                out.append(Delta(index=self.calls, name=json.loads(f'"{head.group(1)}"')))
                self._named = True
            args = self._text[head.end():]
            close = args.find(self.fmt.closer)
            if close < 0:  # hold back what may be the closer's start, then the call object's own "}"
                shown = args[:len(args) - _held(args, self.fmt.closer)].rstrip()
                self._send(shown[:-1].rstrip() if shown.endswith("}") else shown, out)
                return out
            final = args[:close].rstrip()
            self._send(final[:-1].rstrip() if final.endswith("}") else final, out)
            self.calls, self._sent, self._named = self.calls + 1, 0, False
            self._after, self._region = head.end() + close + len(self.fmt.closer), None

    def _send(self, args: str, out: list[Delta]) -> None:
        if len(args) > self._sent:
            out.append(Delta(index=self.calls, arguments=args[self._sent:]))
            self._sent = len(args)
