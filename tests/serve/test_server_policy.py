"""`specdecode serve --api-key --max-body-bytes --request-timeout` for real: a server process serving SmolLM2,
driven by the official `openai` client and raw HTTP. Without the key (or with a wrong one) every route but
/health is a 401; with it the server answers; a body over the limit is a 413; a request past its deadline is
cancelled, a 504 or an error event ending its stream, and its slot is free."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from specdecode.bench.serve_command import Server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.integration
KEY = "test-key-7f3a"


@pytest.fixture(scope="module")
def server(smollm2_path):
    srv = Server("auth", ["--model", str(smollm2_path), "--served-model-name", "m", "--threads", "1",
                          "--max-running", "1", "--api-key", KEY, "--max-body-bytes", "64K", "--request-timeout", "1.5",
                          "--log-level", "warning"])
    try:
        srv.wait_ready(timeout=180)
        yield srv.url
    finally:
        srv.stop()


def _status(url: str, data: bytes | None = None, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_openai_client_needs_the_key(server):
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    right = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    reply = right.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert reply.usage.completion_tokens == 2


def test_every_route_but_health_is_closed_without_the_key(server):
    assert _status(server + "/health") == 200
    for path in ("/metrics", "/v1/models"):
        assert _status(server + path) == 401 and _status(server + path, key=KEY) == 200


def test_a_body_over_the_limit_is_413(server):
    body = json.dumps({"model": "m", "prompt": "x" * 70_000, "max_tokens": 1}).encode()
    assert _status(server + "/v1/completions", body, key=KEY) == 413


COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # never reaches end-of-sequence early


def test_a_request_past_its_deadline_is_cancelled(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="m", prompt=COUNTING, max_tokens=3000, temperature=0)
    assert err.value.status_code == 504 and "deadline" in err.value.message
    assert time.monotonic() - start < 10  # 3000 tokens would take far longer on one thread
    texts = []
    with pytest.raises(openai.APIError, match="deadline"):  # the error event ending the stream
        for event in client.completions.create(model="m", prompt=COUNTING, max_tokens=3000, temperature=0,
                                               stream=True):
            texts.append(event.choices[0].text)
    assert "".join(texts)  # it streamed first
    running = urllib.request.urlopen(urllib.request.Request(server + "/metrics", headers={
        "Authorization": f"Bearer {KEY}"}), timeout=30).read().decode()
    assert "vllm:num_requests_running{" in running and all(
        float(line.rsplit(" ", 1)[1]) == 0 for line in running.splitlines()
        if line.startswith("vllm:num_requests_running{"))
