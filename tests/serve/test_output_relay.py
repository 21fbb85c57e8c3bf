"""OutputRelay: outputs handed from another thread reach each queue in order, with one wake-up of the event loop
for the outputs that arrive while it is busy (not one per output)."""

from __future__ import annotations

import asyncio
import threading

from specdecode.batch.sequence import Output
from specdecode.serve.relay import OutputRelay


def _output(text: str, finish: str | None = None) -> Output:
    return Output(text=text, token_ids=[], finish_reason=finish)


def test_a_steps_outputs_wake_the_loop_once_and_keep_their_order():
    async def main() -> tuple[int, list[str], list[str]]:
        relay = OutputRelay(asyncio.get_running_loop())
        wakes = []
        deliver = relay._deliver
        relay._deliver = lambda: (wakes.append(1), deliver())  # counts the loop's wake-ups
        a, b = asyncio.Queue(), asyncio.Queue()

        def engine_step() -> None:  # one step's outputs for two requests, then a second step's
            for text in ("a1", "b1", "a2"):
                relay.put(a if text[0] == "a" else b, _output(text))

        worker = threading.Thread(target=engine_step)
        worker.start()
        worker.join()  # the loop is busy (here: this coroutine) while the outputs arrive
        await asyncio.sleep(0)  # the loop delivers them
        relay.put(b, _output("b2", "stop"))
        got_a = [(await a.get()).text for _ in range(2)]
        got_b = [(await b.get()).text for _ in range(2)]
        return len(wakes), got_a, got_b

    wakes, got_a, got_b = asyncio.run(main())
    assert (got_a, got_b) == (["a1", "a2"], ["b1", "b2"])
    assert wakes == 2  # one for the three outputs of the first step, one for the last
