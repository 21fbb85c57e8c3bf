"""The thread that owns a :class:`~specdecode.batch.executor.BatchEngine` and steps it while there is work.

Other threads (the HTTP server's event loop) never touch the engine: :meth:`EngineLoop.submit` and
:meth:`EngineLoop.cancel` post commands that the loop thread runs between steps, and outputs come back
through each request's callback, called on the loop thread. A step that raises fails the requests it
was serving (each gets an ``error`` output naming the exception) and the loop goes on serving; a command
that raises is logged and the loop goes on too.

It does not speak HTTP (``app.py``) or format responses (``replies.py``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from specdecode.batch.executor import BatchEngine
from specdecode.batch.sequence import Output, SequenceState
from specdecode.serve.kernel_team import use_kernel_threads

log = logging.getLogger("specdecode.serve")


class EngineLoop:
    """Steps ``engine`` on a thread of its own.

    Args:
        engine: the batch engine (used by this loop's thread only, once started).
        threads: the kernels' threads, whose OpenMP team this loop's thread owns (``kernel_team.py``).
        on_step: called with the engine after every step and after commands ran (e.g. to set gauges).
    """

    def __init__(self, engine: BatchEngine, threads: int, on_step: Callable[[BatchEngine], None] | None = None) -> None:
        self.engine = engine
        self.threads = threads
        self._on_step = on_step
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdecode-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, on_output: Callable[[SequenceState, Output], None], **request: Any) -> Future:
        """Queues a request (keyword arguments of ``BatchEngine.submit``); the future gives its SequenceState, or
        the ValueError / QueueFullError that refused it."""
        future: Future = Future()

        def command() -> None:
            try:
                future.set_result(self.engine.submit(on_output=on_output, **request))
            except Exception as exc:  # handed to the caller, who turns it into an HTTP error
                future.set_exception(exc)
        self._post(command)
        return future

    def cancel(self, seq: SequenceState) -> None:
        """Ends a sequence at the next step boundary, freeing its slot (a client went away)."""
        self._post(lambda: self.engine.cancel(seq))

    def stop(self, timeout: float = 30.0) -> None:
        """Lets running and waiting requests finish for up to ``timeout`` seconds, cancels the rest, and joins."""
        deadline = time.monotonic() + timeout
        while self.alive and time.monotonic() < deadline and self.engine.has_work:
            time.sleep(0.05)

        def cancel_all() -> None:
            for seq in [*self.engine.scheduler.running, *self.engine.scheduler.waiting]:
                self.engine.cancel(seq)
        self._post(cancel_all)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10.0)

    def _post(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        use_kernel_threads(self.threads)
        while True:
            ran = 0
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                try:
                    command()
                except Exception:  # one command's failure (a cancel, ...) must not stop the thread serving all
                    log.exception("engine command failed")
                ran += 1
            if ran and self._on_step is not None:  # a cancel may have freed a slot with no step to follow
                self._on_step(self.engine)
            if self._stop.is_set():
                return
            if not self.engine.has_work:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception as exc:
                log.exception("engine step failed")
                self._fail_all(exc)
            if self._on_step is not None:
                self._on_step(self.engine)

    def _fail_all(self, exc: Exception) -> None:
        """Ends every request after a failed step: its KV state is unknown."""
        for seq in [*self.engine.scheduler.running, *self.engine.scheduler.waiting]:
            seq.error = f"{type(exc).__name__}: {exc}"
            self.engine.cancel(seq, "error")
