"""How one request's outputs reach the event loop from the engine's thread: :class:`OutputRelay` (one wake-up of
the loop for the outputs a step hands over together) and :class:`Handle` (a request's queue, and a whole answer's
texts gathered on the engine's thread).

It does not format answers (``replies.py``) or watch for clients that go away (``app.py``).
"""

from __future__ import annotations

import asyncio
import threading
import time

from specdecode.batch.sequence import Output, SequenceState
from specdecode.logprobs import TokenLogprob


class OutputRelay:
    """Hands outputs from the engine's thread to the event loop with one wake-up of the loop for the outputs
    that arrive together (a step's, one per running request) rather than one per output: each wake-up costs
    both threads CPU. Each queue gets its outputs in the order they came.

    Args:
        loop: the event loop that reads the queues.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Output]] = []

    def put(self, queue: asyncio.Queue, output: Output) -> None:
        """Queues ``output`` for ``queue`` (from any thread); wakes the loop unless a wake-up is already due."""
        with self._lock:
            self._pending.append((queue, output))
            if len(self._pending) > 1:  # the wake-up that the first of them asked for has not run yet
                return
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop has closed: nobody reads these any more, and the next put must wake again
            with self._lock:
                self._pending.clear()

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, output in pending:
            queue.put_nowait(output)


class Handle:
    """One request's outputs, moved from the engine's thread to the event loop's. A streamed request hands over
    every output; a whole one only its last (its texts gather on the engine's thread).

    Args:
        relay: what hands outputs to the event loop.
        stream: whether the request streams.
    """

    def __init__(self, relay: OutputRelay, stream: bool) -> None:
        self._relay = relay
        self.stream = stream
        self.outputs: asyncio.Queue[Output] = asyncio.Queue()
        self.texts: list[str] = []  # a whole request's texts before its last output
        self.logprobs: list[TokenLogprob] = []  # and their tokens' log-probabilities, if asked
        self.seq: SequenceState | None = None
        self.came = time.monotonic()
        self.timed_out = False  # cancelled at its deadline

    def on_output(self, seq: SequenceState, output: Output) -> None:
        if not self.stream and output.finish_reason is None:
            self.texts.append(output.text)  # read only after the last output, which the loop gets after this
            self.logprobs += output.logprobs or []
            return
        self._relay.put(self.outputs, output)
