"""Which thread of a server runs the kernels on several cores: the engine loop's, and no other.

libgomp (torch's OpenMP) keeps a team of worker threads for every thread that opens a parallel region. Once a
process holds more such workers than it has cores, libgomp's barriers stop spinning and sleep on a futex at
once; a fused forward waits at about a hundred of them, and a step on 2 kernel threads then runs 1.6-1.8x longer
(docs/benchmarks/history.md, "One OpenMP team"). A server that loads its model on the thread that later runs
the event loop, and steps on the engine loop's thread, has two teams. So the serving thread runs its own torch
ops on one thread (no team), the model loads on a passing thread whose team ends with it, and the engine loop
owns the only team.

It does not choose how many threads the kernels get (``cores.server_threads``).
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def use_kernel_threads(threads: int) -> None:
    """The calling thread's parallel regions run on ``threads`` threads from now on.

    Reading the count back latches it: torch otherwise resets a thread's count, at its first parallel op, to
    the last count any thread set.
    """
    torch.set_num_threads(threads)
    torch.get_num_threads()


def on_passing_thread(work: Callable[[], T], threads: int, name: str = "specdecode-load") -> T:
    """``work()`` run with ``threads`` kernel threads on a thread of its own, whose OpenMP team ends with it;
    returns its result or raises its exception."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        use_kernel_threads(threads)
        try:
            result.append(work())
        except BaseException as exc:  # re-raised on the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
