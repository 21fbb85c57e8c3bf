"""`specdecode serve` for real: a server process on 127.0.0.1 serving SmolLM2, driven by the official `openai`
client and by raw HTTP. Greedy answers under concurrency equal a solo `generate`; streams equal non-streamed
answers; a dropped stream frees its slot; bad input gets a 400 naming the field; a full queue a 429; a bounded
load test answers every request once with flat memory; SIGTERM lets running requests finish and exits cleanly.

The tests share one server and run in file order (the SIGTERM test last).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from copied_text import copied_tokens
from specdecode.bench.serve_command import Server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.integration

MODEL = "smollm2"
MAX_RUNNING, MAX_WAITING = 4, 8
PROMPTS = ["def quicksort(items):", "The three primary colors are", "Once upon a time, in a small village,",
           "import numpy as np\n\ndef normalize(v):", "Q: What is the boiling point of water?\nA:",
           "List of planets: Mercury, Venus,", "SELECT name, age FROM users WHERE", "Dear team, I am writing to"]


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def server(smollm2_path):
    srv = Server("test", ["--model", str(smollm2_path), "--served-model-name", MODEL, "--threads", "2", "--max-running",
                          str(MAX_RUNNING), "--max-waiting", str(MAX_WAITING), "--log-level", "warning"])
    try:
        srv.wait_ready(timeout=180)
    except RuntimeError as exc:
        srv.proc.kill()
        pytest.fail(str(exc))
    srv.proc.output = srv.output
    yield srv.proc, srv.url
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait()
    srv.log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def solo(smollm2):
    """A solo, in-process ``generate`` with the same model file: what each served greedy answer must equal."""
    from specdecode.engine import Engine

    engine = Engine(smollm2.model, smollm2.tokenizer)
    return lambda prompt, n: engine.generate(prompt, max_new_tokens=n).text


def _post(base: str, path: str, body: bytes | dict) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    return sum(values)


def _wait_for(base: str, name: str, value: float, message: str = "", timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(base, name) != value:
        assert time.monotonic() < deadline, f"{message or name} after {timeout:.0f} s: {_metric(base, name)}"
        time.sleep(0.02)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(server[1] + "/health") as r:
        assert json.loads(r.read()) == {"status": "ok"}


def test_structured_outputs_are_made_ready_at_start(server):
    """llguidance's view of the vocabulary is built before the server listens, not at the first request."""
    assert "structured outputs ready" in server[0].output()


def test_completion_streamed_and_not_equal_a_solo_generate(client, solo):
    want = solo(PROMPTS[0], 48)
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=48, temperature=0)
    assert full.choices[0].text == want and full.choices[0].finish_reason in ("stop", "length")
    spec = full.usage.model_extra["speculation"]
    assert full.usage.completion_tokens == 48 or full.choices[0].finish_reason == "stop"
    assert set(spec) == {"drafted_tokens", "accepted_tokens", "mean_accepted_length"}
    assert spec["mean_accepted_length"] >= 1.0
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=48, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_chat_streamed_and_not(client, smollm2, solo):
    messages = [{"role": "user", "content": "Name three fruits, comma separated."}]
    prompt = smollm2.tokenizer.apply_chat_template(messages)
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    assert full.choices[0].message.content == solo(prompt, 32) and full.choices[0].message.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in
              client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0, stream=True)]
    assert "".join(pieces) == full.choices[0].message.content


def test_stop_strings_and_seeded_sampling(client):
    out = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=30, temperature=0, stop=["7"])
    assert "7" not in out.choices[0].text and out.choices[0].finish_reason == "stop"
    runs = [client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0.9, seed=11)
            .choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]


ORIGINAL = ("def average(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)"
            "\n\n\ndef largest(numbers):\n    best = numbers[0]\n    for n in numbers:\n        if n > best:\n"
            "            best = n\n    return best\n")
EDIT = [{"role": "user", "content": "Rename the variable `total` to `acc` in this Python code. Return only the whole "
                                    f"updated code, no explanation.\n\n```python\n{ORIGINAL}```"}]


def test_a_prediction_through_the_openai_client_drafts_and_counts(client, smollm2, solo):
    """OpenAI's ``prediction`` parameter: the answer is the same as without it, and usage says how many of the
    prediction's tokens the completion kept (OpenAI's ``completion_tokens_details``)."""
    prompt = smollm2.tokenizer.apply_chat_template(EDIT)
    out = client.chat.completions.create(model=MODEL, messages=EDIT, max_tokens=64, temperature=0,
                                         prediction={"type": "content", "content": ORIGINAL})
    assert out.choices[0].message.content == solo(prompt, 64)
    details = out.usage.completion_tokens_details
    tok = smollm2.tokenizer  # at least half of what the answer copies from the original (copied_text.py)
    copied = copied_tokens(tok.encode(out.choices[0].message.content), tok.encode(ORIGINAL))
    assert copied >= 6 and details.accepted_prediction_tokens >= copied // 2, (copied, out.usage)
    assert details.rejected_prediction_tokens >= 0
    plain = client.chat.completions.create(model=MODEL, messages=EDIT, max_tokens=64, temperature=0)
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    # Text parts, streamed, with the usage chunk.
    parts = [{"type": "text", "text": ORIGINAL[:30]}, {"type": "text", "text": ORIGINAL[30:]}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=EDIT, max_tokens=64, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 prediction={"type": "content", "content": parts}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == details.accepted_prediction_tokens


def test_a_prediction_on_completions_and_a_bad_one(server, solo):
    prompt = "def largest(numbers):\n    best = numbers[0]\n"
    status, _, reply = _post(server[1], "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 40,
                                                            "temperature": 0, "prediction": {"type": "content",
                                                                                             "content": ORIGINAL}})
    assert status == 200 and reply["choices"][0]["text"] == solo(prompt, 40), reply
    assert "accepted_prediction_tokens" in reply["usage"]["completion_tokens_details"]
    status, _, reply = _post(server[1], "/v1/completions", {"model": MODEL, "prompt": "x",
                                                            "prediction": {"type": "text", "content": "y"}})
    assert status == 400 and reply["error"]["param"].startswith("prediction"), reply


def test_concurrent_greedy_requests_each_equal_a_solo_generate(client, solo):
    def ask(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, PROMPTS))
    assert answers == [solo(p, 24) for p in PROMPTS]


def test_a_dropped_stream_frees_its_slot(client, server):
    base = server[1]
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=2000, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert _metric(base, "vllm:num_requests_running") == 1
    stream.close()
    _wait_for(base, "vllm:num_requests_running", 0, "the dropped stream still holds its slot")


def test_a_dropped_whole_request_frees_its_slot(server):
    """A non-streamed request hears of no output until its last; the client going away still ends it, within
    about a second (the watcher's poll), long before its 2000 tokens would."""
    import http.client

    base = server[1]
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 2000,
                                                        "temperature": 0}), {"Content-Type": "application/json"})
    _wait_for(base, "vllm:num_requests_running", 1, "the request did not start")
    conn.close()
    _wait_for(base, "vllm:num_requests_running", 0, "the dropped request still holds its slot", timeout=5.0)


@pytest.mark.parametrize("body, param, fragment", [
    (b'{"model": "smollm2", "prompt": ', None, "not valid JSON"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"model": MODEL}, "prompt", "Field required"),
    ({"model": "gpt-4", "prompt": "x"}, "model", "is not served here"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 100000}, "max_tokens", "exceed the 4096 tokens"),
    ({"model": MODEL, "prompt": "word " * 5000}, "prompt", "at most 4096 tokens"),
    ({"model": MODEL, "prompt": "x", "n": 9}, "n", "less than or equal to 8"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, "stop", "must not be empty"),
    ({"model": MODEL, "prompt": [1, 10 ** 9]}, "prompt", "token ids must be in"),
])
def test_bad_requests_get_a_400_naming_the_field(server, body, param, fragment):
    status, _, reply = _post(server[1], "/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == param and fragment in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error"


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize("extra, param", [
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"suffix": "end"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"echo": True}, "echo"),
    ({"min_tokens": 4}, "min_tokens"),
    ({"modalities": ["text", "audio"]}, "modalities"),
])
def test_fields_this_server_does_not_implement_get_a_400_naming_them(server, extra, param):
    status, _, reply = _post(server[1], "/v1/chat/completions", {**CHAT, **extra})
    assert status == 400 and reply["error"]["param"] == param and "not supported" in reply["error"]["message"], reply


def test_fields_left_at_their_defaults_or_without_effect_are_accepted(server):
    body = {**CHAT, "max_tokens": 4, "tools": [], "response_format": {"type": "text"}, "logprobs": None,
            "top_logprobs": 0,
            "echo": False, "user": "u-1", "metadata": {"k": "v"}, "some_future_field": 1}
    status, _, reply = _post(server[1], "/v1/chat/completions", body)
    assert status == 200 and reply["choices"][0]["message"]["content"] and reply["choices"][0]["logprobs"] is None
    status, _, reply = _post(server[1], "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                            "logprobs": False})
    assert status == 200 and reply["choices"][0]["logprobs"] is None, reply


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a\udfffb"}]},
     "messages.0.content"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["ok", "\ud800"]}, "stop.1"),
])
def test_text_that_is_not_unicode_gets_a_400_naming_the_field(server, path, body, param):
    status, _, reply = _post(server[1], path, json.dumps(body).encode())  # json escapes the lone surrogate
    assert status == 400 and reply["error"]["param"] == param and "not valid Unicode" in reply["error"]["message"]


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                         "color": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "color"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON: name, age and favourite color."}]


def test_response_format_json_schema_and_json_object_through_the_openai_client(client, server, smollm2):
    """Answers parse and validate; greedy ones equal constrained plain decoding in process (the server drafts,
    forced tokens included, and counts those apart)."""
    import jsonschema

    from specdecode.engine import Engine
    from specdecode.grammar import Grammar

    plain = Engine(smollm2.model, smollm2.tokenizer)
    prompt = smollm2.tokenizer.apply_chat_template(ASK)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    forced_before = _metric(server[1], "specdecode:forced_draft_tokens_total")
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0,
                                           response_format=fmt)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert whole.choices[0].finish_reason == "stop"
    assert text == plain.generate(prompt, max_new_tokens=64, grammar=Grammar.json_schema(PERSON)).text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=64, temperature=0, response_format=fmt, stream=True) if c.choices)
    assert streamed == text
    assert _metric(server[1], "specdecode:forced_draft_tokens_total") > forced_before
    assert _metric(server[1], "specdecode:forced_accepted_tokens_total") > 0
    for seed in range(3):  # sampled answers are valid too
        sampled = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0.7,
                                                 seed=seed, response_format=fmt)
        jsonschema.validate(json.loads(sampled.choices[0].message.content), PERSON)
    anything = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=48, temperature=0,
                                              response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:  # cut by the budget: an object still open
        assert anything.choices[0].message.content.startswith("{")


def test_structured_outputs_regex_and_choice_with_logprobs_of_the_masked_distribution(client, smollm2):
    choices = ["red", "green", "blue"]
    reply = client.completions.create(model=MODEL, prompt="My favourite color is", max_tokens=8, temperature=0,
                                      logprobs=5, extra_body={"structured_outputs": {"choice": choices}})
    assert reply.choices[0].text in choices and reply.choices[0].finish_reason == "stop"
    first = reply.choices[0].logprobs.top_logprobs[0]
    assert first and all(any(c.startswith(t.strip()) and t.strip() for c in choices) for t in first), first
    # Of the masked distribution: the few allowed first tokens hold nearly all of it (unmasked, "red" without a
    # leading space is unlikely here).
    assert 0.9 < sum(math.exp(v) for v in first.values()) <= 1 + 1e-4
    date = r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"
    dated = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "When? A date."}],
                                           max_tokens=16, temperature=0, extra_body={"structured_outputs": {"regex": date}})
    assert re.fullmatch(date, dated.choices[0].message.content)


def test_logprobs_under_a_schema_list_only_tokens_it_allows(client, server):
    """Forced rows allow one token: their alternatives are that token alone (no -inf in the JSON, streamed or not)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0,
                                           response_format=fmt, logprobs=True, top_logprobs=5)
    content = whole.choices[0].logprobs.content
    assert "".join(c.token for c in content).startswith(whole.choices[0].message.content[:10])
    assert any(len(c.top_logprobs) == 1 and c.logprob == 0.0 for c in content)  # a forced token
    assert all(math.isfinite(t.logprob) for c in content for t in c.top_logprobs)
    status, _, reply = _post(server[1], "/v1/completions", {"model": MODEL, "prompt": "Name:", "max_tokens": 16,
                                                            "logprobs": 5, "response_format": {"type": "json_object"},
                                                            "stream": False})
    assert status == 200 and reply["choices"][0]["logprobs"]["top_logprobs"], reply
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0,
                                              response_format=fmt, logprobs=True, top_logprobs=3, stream=True)
    assert sum(len(c.choices[0].logprobs.content) for c in streamed if c.choices and c.choices[0].logprobs) > 0


@pytest.mark.parametrize("extra, param, fragment", [
    ({"structured_outputs": {"regex": "a\udfffb"}}, "structured_outputs.regex", "not valid Unicode"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": "\ud800"}}}},
     "response_format.json_schema.schema.const", "not valid Unicode"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs its json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                 "schema": {"type": "string", "format": "nope"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "Input should be"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "does not compile"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar", "Extra inputs"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
])
def test_structured_output_requests_that_cannot_be_served_get_a_400_naming_the_field(server, extra, param, fragment):
    # (json escapes a lone surrogate, which JSON allows and Unicode does not)
    status, _, reply = _post(server[1], "/v1/chat/completions", json.dumps({**CHAT, **extra}).encode())
    assert status == 400 and reply["error"]["param"] == param and fragment in reply["error"]["message"], reply


@pytest.fixture(scope="module")
def solo_logprobs(smollm2):
    """Plain decoding's (no drafts, alone) greedy tokens and log-probabilities with 2 alternatives, in process."""
    from specdecode.batch.executor import BatchEngine

    def run(prompt: str, n: int) -> list:
        engine = BatchEngine(smollm2.model, smollm2.tokenizer)
        got = []
        engine.submit(prompt, max_new_tokens=n, logprobs=2, on_output=lambda seq, out: got.extend(out.logprobs))
        while engine.has_work:
            engine.step()
        return got
    return run


def test_logprobs_equal_plain_decodings_on_both_endpoints_streamed_or_not(client, server, smollm2, solo_logprobs):
    """The server drafts (n-gram); its log-probabilities are plain decoding's, in OpenAI's shapes."""
    prompt = PROMPTS[0]
    want = solo_logprobs(prompt, 12)
    name = lambda t: smollm2.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    assert lp.tokens == [name(x.token) for x in want] and len(lp.top_logprobs[0]) == 2
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want], abs=1e-6)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == whole.choices[0].text
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2, stream=True) if c.choices]
    assert [t for s in streamed if s for t in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob
                                     for c in content)
    assert "".join(c.token for c in content).startswith(chat.choices[0].message.content)
    assert b"".join(bytes(c.bytes) for c in content).decode().startswith(chat.choices[0].message.content)
    status, _, reply = _post(server[1], "/v1/chat/completions", {**CHAT, "top_logprobs": 2})
    assert status == 400 and reply["error"]["param"] == "top_logprobs"


def test_logprobs_bytes_join_to_the_answer_where_its_tokens_split_characters(client):
    answer = "café ☕ 日本"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say it."}],
                                          max_tokens=24, temperature=0, logprobs=True,
                                          extra_body={"structured_outputs": {"choice": [answer]}})
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.content == answer
    assert any("\ufffd" in c.token for c in content)  # a token alone is part of a character
    assert b"".join(bytes(c.bytes) for c in content) == answer.encode()


def test_chat_with_a_wrong_message_shape_gets_a_400(server):
    status, _, reply = _post(server[1], "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot"}]})
    assert status == 400 and reply["error"]["param"].startswith("messages.0.role"), reply


def test_a_full_queue_answers_429_with_retry_after(server):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0}
    with ThreadPoolExecutor(24) as pool:
        replies = list(pool.map(lambda _: _post(server[1], "/v1/completions", body), range(24)))
    statuses = [status for status, _, _ in replies]
    assert set(statuses) == {200, 429} and statuses.count(200) >= MAX_RUNNING + MAX_WAITING, statuses
    refused = next(r for r in replies if r[0] == 429)
    assert refused[1].get("retry-after") == "1" or refused[1].get("Retry-After") == "1"
    assert refused[2]["error"]["type"] == "rate_limit_exceeded"
    answers = {r[2]["choices"][0]["text"] for r in replies if r[0] == 200}
    assert len(answers) == 1  # every admitted request got the same greedy answer


def test_bounded_load_every_request_answered_once_no_leaks_flat_memory(client, server):
    """A soak of 200 requests from 8 clients, a mix of whole and streamed answers, refused requests and streams
    dropped after their first chunk: every valid request is answered once, every refused one a 400, the dropped
    ones free their slots, and memory stays flat."""
    proc, base = server
    generated_before = _metric(base, "vllm:generation_tokens_total")
    first_tokens_before = _metric(base, "vllm:time_to_first_token_seconds_count")
    rss_before = _rss_bytes(proc.pid)
    start = time.monotonic()

    def ask(i):
        prompt = PROMPTS[i % len(PROMPTS)] + f" ({i})"
        kind = ("whole", "stream", "refused", "dropped")[i % 4]
        if kind == "whole":
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
            return i, kind, r.id, r.usage.completion_tokens
        if kind == "refused":
            status, _, reply = _post(base, "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                               "best_of": 5})
            return i, kind, status, reply["error"]["param"]
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4 if kind == "stream" else 500,
                                           temperature=0, stream=True)
        ids, tokens = set(), 0
        for chunk in stream:
            ids.add(chunk.id)
            tokens += bool(chunk.choices and chunk.choices[0].text)
            if kind == "dropped":
                stream.close()
                break
        return i, kind, ids.pop(), tokens
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(200)))
    elapsed = time.monotonic() - start
    assert sorted(r[0] for r in results) == list(range(200))
    answered = [r for r in results if r[1] in ("whole", "stream")]
    assert len({r[2] for r in answered}) == 100 and all(r[3] >= 1 for r in answered)
    assert all(r[2:] == (400, "best_of") for r in results if r[1] == "refused")
    assert elapsed < 120, f"200 requests took {elapsed:.0f} s"
    assert _metric(base, "vllm:generation_tokens_total") - generated_before >= sum(r[3] for r in answered)
    assert _metric(base, "vllm:time_to_first_token_seconds_count") - first_tokens_before == 150  # answered + dropped
    _wait_for(base, "vllm:num_requests_running", 0)  # the gauges are set after the step that answered
    assert _metric(base, "vllm:num_requests_waiting") == 0 and _metric(base, "vllm:kv_cache_usage_perc") == 0
    grown = _rss_bytes(proc.pid) - rss_before
    assert grown < 64 * 2 ** 20, f"the server's memory grew by {grown / 2 ** 20:.0f} MiB over 200 requests"


def test_metrics_count_speculation(client, server):
    """The counters move by exactly what one request of this test's own reports, whatever earlier tests drafted."""
    base = server[1]
    _wait_for(base, "vllm:num_requests_running", 0)  # nothing else is stepped while this request runs
    names = ["vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_per_pos_total", "vllm:time_to_first_token_seconds_count",
             "vllm:prompt_tokens_total", "vllm:generation_tokens_total"]
    before = [_metric(base, name) for name in names]
    # A repeating prompt: n-gram lookup drafts its continuation, and greedy decoding goes on repeating it. Even
    # with speculation switched off by earlier timings, 64 tokens are more steps than adaptive's probe spacing.
    out = client.completions.create(model=MODEL, prompt="red green blue, " * 12, max_tokens=64, temperature=0)
    drafted, accepted, by_position, first_tokens, prompt, generated = (
        _metric(base, name) - was for name, was in zip(names, before))
    spec = out.usage.model_extra["speculation"]
    assert 0 < spec["accepted_tokens"] <= spec["drafted_tokens"], spec
    assert (drafted, accepted, by_position) == (spec["drafted_tokens"], spec["accepted_tokens"],
                                                spec["accepted_tokens"])
    assert (first_tokens, prompt, generated) == (1, out.usage.prompt_tokens, out.usage.completion_tokens)


def test_sigterm_lets_running_requests_finish_and_exits_cleanly(client, server):
    proc, base = server
    # Two code prompts of 256 tokens: at ~300 tokens/s a 64-token answer could end between two polls of the metric
    # (seen once the attention kernel got faster), and the SIGTERM would then find nothing running.
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(lambda p=p: client.completions.create(model=MODEL, prompt=p, max_tokens=256,
                                                                     temperature=0)) for p in PROMPTS[0:4:3]]
        _wait_for(base, "vllm:num_requests_running", 2, timeout=30)
        os.kill(proc.pid, signal.SIGTERM)
        try:
            answers = [f.result() for f in running]
        except openai.APIError as exc:  # the server's log says why (a 500 from uvicorn has no body)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
            raise AssertionError(f"{exc!r}; the server printed:\n{proc.output()}") from exc
    assert all(a.usage.completion_tokens == 256 or a.choices[0].finish_reason == "stop" for a in answers)
    # uvicorn shuts down gracefully, then re-raises the signal: exit status -SIGTERM, as for any program it stops.
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    output = proc.output()
    assert "Traceback" not in output and "ERROR" not in output, output
