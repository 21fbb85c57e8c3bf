"""llamacpp_server: llama-server is started with the peer's options, waited for, asked for completions of token
ids and stopped; a server that exits is reported with its log. A small Python script stands in for llama-server
(the real one is built by `specdecode peers build`); the real server's benchmark rows are in BENCHMARKS.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from specdecode.bench import llamacpp_tools
from specdecode.bench.llamacpp_server import LlamaServer, ServerOptions
from specdecode.bench.methods import llamacpp_server_method
from specdecode.sampling import SamplingParams

FAKE = '''#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
if "--fail" in " ".join(args) or "broken" in args[args.index("-m") + 1]:
    print("error: cannot load the model"); sys.exit(3)
port = int(args[args.index("--port") + 1])
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers(); self.wfile.write(b"{{}}")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        tokens = [t + 1 for t in body["prompt"]][: body["n_predict"]]
        reply = {{"tokens": tokens, "stop_type": "limit", "args": args, "body": body}}
        data = json.dumps(reply).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture
def fake_server(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    binary = llamacpp_tools.build_dir() / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text(FAKE.format(python=sys.executable))
    binary.chmod(0o755)
    return binary


def test_a_completion_goes_to_the_server_with_the_peers_options(fake_server, tmp_path):
    options = ServerOptions(tmp_path / "m.gguf", threads=2, ctx=512, draft=tmp_path / "d.gguf", draft_max=8)
    with LlamaServer(options) as server:
        reply = server.complete([5, 6, 7], 2, SamplingParams(), seed=3)
    assert reply["tokens"] == [6, 7] and reply["body"]["temperature"] == 0.0 and reply["body"]["cache_prompt"] is False
    args = reply["args"]
    assert args[args.index("-md") + 1] == str(tmp_path / "d.gguf") and args[args.index("--spec-draft-n-max") + 1] == "8"
    assert args[args.index("-t") + 1] == "2" and args[args.index("--parallel") + 1] == "1"
    assert server.server.proc.poll() is not None  # stopped on leaving the block


def test_the_bench_method_times_calls_and_stops_its_server(fake_server, tmp_path):
    method = llamacpp_server_method("llamacpp-server-lookup", tmp_path / "m.gguf", SamplingParams(), 4, 512)
    try:
        out = method.run([1, 2, 3, 4, 5, 6], 0)
    finally:
        method.close()
    assert out.token_ids == [2, 3, 4, 5] and out.finish == "length" and out.seconds > 0
    assert method.kind == "peer" and method.params["spec_type"] == "ngram-simple"


def test_a_server_that_exits_is_reported_with_its_log(fake_server, tmp_path):
    with pytest.raises(RuntimeError, match="llama-server server exited with 3:\nerror: cannot load the model"):
        LlamaServer(ServerOptions(tmp_path / "broken.gguf", threads=1))
