"""The engine loop's thread outlives a command that raises: the requests after it are still served."""

from __future__ import annotations

import logging
import time

from specdecode.batch.executor import BatchEngine
from specdecode.serve.loop import EngineLoop
from tiny_models import tiny_model


def test_a_command_that_raises_is_logged_and_the_loop_serves_on(caplog):
    loop = EngineLoop(BatchEngine(tiny_model()), threads=1)
    loop.start()
    try:
        def fails() -> None:
            raise RuntimeError("boom")
        with caplog.at_level(logging.ERROR, logger="specdecode.serve"):
            loop._post(fails)
            done = []
            seq = loop.submit(lambda s, out: done.append(out.finish_reason), prompt=[1, 2, 3],
                              max_new_tokens=3).result(timeout=30)
            deadline = time.monotonic() + 30
            # the last output, not seq.finished: the engine marks a sequence finished before it hands that over
            while not (done and done[-1] is not None) and time.monotonic() < deadline:
                time.sleep(0.01)
        assert loop.alive and seq.finish_reason == "length" and done[-1] == "length"
        assert "engine command failed" in caplog.text and "boom" in caplog.text
    finally:
        loop.stop(timeout=1)
