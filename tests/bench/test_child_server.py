"""A server child process: a crash or an exit before it is ready is reported with its output and, for a
crash, the signal (``bench/child_server.py``)."""

from __future__ import annotations

import sys

import pytest

from specdecode.bench.child_server import Server, ServerFailed
from specdecode.cli import main

_CRASH = "import os, signal; print('loading the model', flush=True); os.kill(os.getpid(), signal.SIGSEGV)"


def test_a_server_that_crashes_is_named_with_its_signal_and_output():
    server = Server("peer", [], [sys.executable, "-c", _CRASH])
    with pytest.raises(ServerFailed, match="the peer server was killed by SIGSEGV:\nloading the model"):
        server.wait_ready(timeout=60)


def test_a_server_that_exits_silently_says_so():
    server = Server("peer", [], [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(ServerFailed, match="the peer server exited with 3:\n\\(no output\\)"):
        server.wait_ready(timeout=60)


def test_the_command_line_reports_it_as_an_error_not_a_traceback(monkeypatch, capsys):
    def crash(*_args):
        Server("peer", [], [sys.executable, "-c", _CRASH]).wait_ready(timeout=60)
    monkeypatch.setattr("specdecode.cli.COMMANDS", {"bench-serve": crash})
    assert main(["bench-serve"]) == 2
    err = capsys.readouterr().err
    assert "specdecode: error: the peer server was killed by SIGSEGV" in err and "Traceback" not in err
