"""The server's kernel threads: one OpenMP team per process, owned by the engine loop's thread
(``serve/kernel_team.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest
import torch

from specdecode.serve.kernel_team import on_passing_thread, use_kernel_threads


@pytest.fixture(autouse=True)
def _process_count_restored():
    """Setting a thread's count also sets the count new threads start with: put it back for later tests."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_threads_count_holds_when_another_thread_sets_its_own():
    first_set, other_set = threading.Event(), threading.Event()
    seen: list[int] = []

    def first() -> None:
        use_kernel_threads(1)
        first_set.set()
        other_set.wait()
        seen.append(torch.get_num_threads())

    def other() -> None:
        first_set.wait()
        use_kernel_threads(2)
        other_set.set()

    threads = [threading.Thread(target=first), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [1]


def test_on_passing_thread_runs_with_its_threads_and_passes_back_result_and_error():
    use_kernel_threads(1)
    assert on_passing_thread(torch.get_num_threads, 3) == 3 and torch.get_num_threads() == 1

    def fails() -> None:
        raise KeyError("the model")
    with pytest.raises(KeyError, match="the model"):
        on_passing_thread(fails, 2)


_PROBE = textwrap.dedent("""
    import os, sys, threading, torch
    from specdecode.serve.kernel_team import on_passing_thread, use_kernel_threads

    def os_threads():
        return len(os.listdir("/proc/self/task"))

    def parallel_op():
        x = torch.ones(1 << 22)
        return float((x * 2).sum())

    if sys.argv[1] == "server":
        use_kernel_threads(1)  # what build_server does on the serving thread
    on_passing_thread(parallel_op, 2)  # the model's loading
    stepping, done = threading.Event(), threading.Event()

    def engine_loop():
        use_kernel_threads(2)
        parallel_op()
        stepping.set()
        done.wait()

    loop = threading.Thread(target=engine_loop)
    loop.start()
    stepping.wait()
    before = os_threads()
    parallel_op()  # the serving thread's own torch op
    print(os_threads() - before)
    done.set()
    loop.join()
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")
def test_the_serving_threads_torch_ops_open_no_second_team():
    def new_threads(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "OMP_NUM_THREADS": "2"})
        assert run.returncode == 0, run.stderr
        return int(run.stdout.strip().splitlines()[-1])

    assert new_threads("unguarded") >= 1  # the probe sees a second team where nothing prevents one
    assert new_threads("server") == 0


def test_build_server_loads_on_a_passing_thread_and_gives_the_loop_the_kernel_threads(monkeypatch):
    from specdecode.serve import app, server
    from specdecode.serve.config import ServeConfig

    loaded: list = []

    def warm_engine(config, log):
        loaded.append((threading.get_ident(), torch.get_num_threads()))
        return SimpleNamespace(observer=None)
    monkeypatch.setattr(server, "_warm_engine", warm_engine)
    monkeypatch.setattr(app, "build_app", lambda loop, name, metrics, access, lifespan=None: "app")
    switch: list[float] = []
    monkeypatch.setattr(server.sys, "setswitchinterval", switch.append)  # (not this test process's own)
    served = server.build_server(ServeConfig(), lambda _line: None, threads=3)
    assert switch == [server.GIL_SWITCH_S] and server.GIL_SWITCH_S < sys.getswitchinterval()
    assert loaded[0][0] != threading.get_ident() and loaded[0][1] == 3  # the model loads on its own thread
    assert torch.get_num_threads() == 1  # the serving thread keeps one: no second team
    assert served.loop.threads == 3 and served.loop.engine.observer is served.metrics
