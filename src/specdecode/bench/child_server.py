"""A server child process on a free loopback port, its output kept in a temporary file (a pipe that nobody reads
while it serves could fill and block it): ``specdecode serve`` for ``bench-serve``, or a peer's own command
(llama.cpp's llama-server). Started, waited for until a path answers 200, stopped with SIGTERM.

It does not decide what runs (``serve_command.py``, ``llamacpp_server.py``) or send requests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from specdecode.cores import peer_environ


def free_port() -> int:
    """A loopback port that nothing listens on now (the system picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerFailed(RuntimeError):
    """A server child process exited before it was ready, or did not become ready in time (its output named)."""


class Server:
    """A server child process on a free loopback port (``specdecode serve``, or a peer's command); its output
    goes to a temporary file (a pipe nobody reads while it serves could fill and block it).

    Args:
        name: what the errors call it.
        flags: ``specdecode serve`` flags (``--port`` is added).
        command: another server's command line instead, ``{port}`` standing for the port.
        ready: the path that answers 200 once it serves.
    """

    def __init__(self, name: str, flags: list[str], command: list[str] | None = None, ready: str = "/health") -> None:
        self.name, self.flags, self.port, self.ready = name, flags, free_port(), ready
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        argv = [sys.executable, "-m", "specdecode.cli", "serve", "--port", str(self.port), *flags] if command is None \
            else [a.replace("{port}", str(self.port)) for a in command]
        # Our clients send no key: a $SPECDECODE_API_KEY exported here must not lock them out of our server. A peer
        # runs with libgomp's own spinning, unless the user chose one (cores.peer_environ).
        base = os.environ if command is None else peer_environ()
        env = {k: v for k, v in base.items() if k != "SPECDECODE_API_KEY" or "--api-key" in flags}
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Returns once the ready path answers 200; raises ServerFailed if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:  # a negative code: killed by that signal (a crash shows as SIGSEGV)
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
                raise ServerFailed(f"the {self.name} server {how}:\n{self.output() or '(no output)'}")
            try:
                with urllib.request.urlopen(f"{self.url}{self.ready}", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass  # not listening yet, or not ready (503)
            time.sleep(0.2)
        raise ServerFailed(f"the {self.name} server did not answer {self.ready} within {timeout:.0f} s")

    def stop(self) -> None:
        """SIGTERM (the server finishes what runs), then a kill after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
