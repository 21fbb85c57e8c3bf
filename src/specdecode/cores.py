"""How many cores this process may use, and how many kernel threads a server takes of them.

Both ``specdecode serve`` and ``bench-serve``'s peers go by it, and the command line bounds how long libgomp's
threads spin here. It does not set any thread count (``serve/kernel_team.py`` does).
"""

from __future__ import annotations

import os

KEEP_HTTP_CORE_FROM = 8  # cores from which a server leaves one to its HTTP side
SPIN_COUNT = "10000"  # libgomp's spins at a barrier before its thread sleeps (its own default: 300,000)
_bound_here = False  # whether bound_openmp_spin set this process's GOMP_SPINCOUNT


def server_threads(cores: int | None = None) -> int:
    """The kernel threads a server runs by default: every core this process may use, but one from 8 cores up.

    With one OpenMP team in the process (``serve/kernel_team.py``) the HTTP side (event loop, chat templates,
    tokenization, SSE) takes little of a core: on 2 cores, 2 kernel threads served plain decoding at
    0.84-1.03x the library's tokens/s at 1-8 clients, 1 thread at 0.61-0.79x (docs/benchmarks/history.md,
    "One OpenMP team"). From ``KEEP_HTTP_CORE_FROM`` cores on, a core costs the kernels at most an eighth of
    their compute and is left to the HTTP side, whose work grows with the requests in flight (a judgement: no
    machine here had more than 2 cores to measure it on).
    """
    cores = usable_cores() if cores is None else cores
    return max(1, cores - (cores >= KEEP_HTTP_CORE_FROM))


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def oversubscription_warning(threads: int, cores: int | None = None) -> str | None:
    """The warning a thread count above the usable cores gets (None when it fits): the kernels' threads then
    wait for each other at every barrier: SmolLM2's plain decoding ran 65 tok/s on 3 threads against 212 on 2, on
    2 cores (BENCHMARKS.md X-13)."""
    cores = usable_cores() if cores is None else cores
    if threads <= cores:
        return None
    return (f"warning: --threads {threads} is more than the {cores} core(s) this process may use: the kernels' "
            "threads will wait on each other at every step (many times slower); use at most "
            f"--threads {cores}")


def bound_openmp_spin(environ: dict[str, str] | None = None) -> None:
    """Bounds libgomp's spinning at ``SPIN_COUNT`` unless the user chose a spin count or wait policy.

    libgomp reads it once, when torch loads it, so this runs before ``import torch``. Its default spin (~16 ms
    on a Xeon) keeps the kernels fast on cores of their own, but where another process also spins on the same
    cores, each of a forward's ~100 barriers can wait out a time slice: a 64-token answer of SmolLM2 took
    20-35 s beside a 2-thread torch loop, 2.2 s at this count, 0.2 s alone either way
    (docs/benchmarks/history.md, "Bounded spinning").
    """
    global _bound_here
    own = environ is None
    environ = os.environ if environ is None else environ
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        _bound_here = _bound_here or own


def peer_environ() -> dict[str, str]:
    """This process's environment for another program (llama.cpp's tools, measured as their users run them):
    without the spin count ``bound_openmp_spin`` set here; one the user set stays."""
    return {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT" or not _bound_here}
