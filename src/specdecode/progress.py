"""A progress bar on stderr for long runs (``specdecode bench``, ``train-head``'s data and epochs).

It only draws; it does not time or log anything else.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """A one-line progress bar on a terminal stream (stderr), redrawn at most ten times a second.

    On a stream that is not a terminal (a log file) it prints a plain status line at most every
    ``log_every`` seconds, and one summary line on ``close``.
    """

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 28, enabled: bool = True,
                 log_every: float = 30.0, unit: str = "timed calls") -> None:
        self.total, self.done, self.width, self.unit = max(total, 1), 0, width, unit
        self.log_every = log_every
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._last_len = 0

    def update(self, label: str = "", step: int = 1) -> None:
        self.done = min(self.total, self.done + step)
        now = time.perf_counter()
        if self.tty and (now - self._last_draw > 0.1 or self.done == self.total):
            self._last_draw = now
            self._draw(label)
        elif self.enabled and not self.tty and now - max(self._last_draw, self.start) >= self.log_every:
            self._last_draw = now
            self.stream.write(self._status(label) + "\n")
            self.stream.flush()

    def _status(self, label: str) -> str:
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        return f"{self.done}/{self.total} {self.unit}, {elapsed:.0f}s elapsed, ~{eta:.0f}s left  {label[:40]}"

    def _draw(self, label: str) -> None:
        filled = int(self.done / self.total * self.width)
        line = f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self._status(label)}"
        pad = max(0, self._last_len - len(line))
        self.stream.write(line + " " * pad)
        self.stream.flush()
        self._last_len = len(line)

    def message(self, text: str) -> None:
        """Prints a line without garbling the bar."""
        if self.tty and self._last_len:
            self.stream.write("\r" + " " * self._last_len + "\r")
            self._last_len = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\n")
        else:
            self.stream.write(f"ran {self.done}/{self.total} {self.unit} in {time.perf_counter() - self.start:.1f} s\n")
        self.stream.flush()
