"""`specdecode serve` on Ray Serve for real: a local Ray cluster started here (2 CPUs, no dashboard), two
engine replicas of SmolLM2 behind the ingress, driven through Ray's HTTP proxy by the `openai` client.
Requests reach both replicas; greedy answers equal a solo `generate`; a shared prefix keeps to one replica;
both replicas' metrics come through one /metrics; a replica that cannot load fails its deployment with the
load error; shutdown leaves no Ray process behind. Marked slow: a replica killed under load (its requests
retried or failed with a clear error, none hangs, Ray replaces it) and the `serve --ray` command itself.

The tests share one cluster and run in file order (the shutdown test last among the quick ones).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from specdecode.bench.child_server import free_port  # noqa: E402
from specdecode.serve.ray_app import (APP_NAME, METRICS_PUSH_S, DeploymentError, build_application,  # noqa: E402
                                      run_application, serve_flags)

# One worker runs every test that starts a Ray cluster (`make test` runs pytest-xdist with --dist loadgroup).
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("ray")]

MODEL = "smollm2"
PROMPTS = ["def quicksort(items):", "The three primary colors are", "Once upon a time, in a small village,",
           "import numpy as np\n\ndef normalize(v):", "Q: What is the boiling point of water?\nA:",
           "List of planets: Mercury, Venus,"]
SHARED = ("You are a careful assistant for a travel agency. Answer in one short sentence, politely, and never "
          "invent prices or dates. The customer asks: ")


KEY = "ray-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _flags(model: Path | str, *extra: str) -> list[str]:
    return ["--model", str(model), "--served-model-name", MODEL, "--drafter", "ngram", "--max-running", "2",
            "--max-waiting", "8", "--max-len", "1024", "--log-level", "warning", "--api-key", KEY, *extra]


def _processes() -> dict[int, tuple[int, bytes]]:
    """Live (not zombie) processes: pid -> (parent pid, command line)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if state != "Z":
            found[int(pid)] = (int(ppid), cmd)
    return found


def _session_processes(session: str) -> list[bytes]:
    """Command lines of live processes of Ray session ``session`` (this test process excepted)."""
    return [cmd for pid, (_, cmd) in _processes().items() if session.encode() in cmd and pid != os.getpid()]


def _descendants(root: int) -> dict[int, bytes]:
    """Live descendants of process ``root``: pid -> command line."""
    procs, found, frontier = _processes(), {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cmd) in procs.items():
            if ppid == parent and pid not in found:
                found[pid] = cmd
                frontier.append(pid)
    return found


def _alive(processes: dict[int, bytes]) -> list[bytes]:
    """Those of ``processes`` still running (the same pid with the same command line)."""
    procs = _processes()
    return [cmd for pid, cmd in processes.items() if pid in procs and procs[pid][1] == cmd]


@pytest.fixture(scope="module")
def cluster(smollm2_path):
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    session = Path(ray._private.worker._global_node.get_session_dir_path()).name
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # Half a CPU each (one kernel thread): the other half is room for the broken deployment below.
    run_application(build_application(serve_flags(_flags(smollm2_path)), replicas=2, cpus_per_replica=0.5))
    state = {"url": f"http://127.0.0.1:{port}", "session": session}
    yield state
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster["url"] + "/v1", api_key=KEY, max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def solo(smollm2):
    from specdecode.engine import Engine

    engine = Engine(smollm2.model, smollm2.tokenizer)
    return lambda prompt, n: engine.generate(prompt, max_new_tokens=n).text


def _complete(client, prompt: str, n: int = 24) -> tuple[str, str]:
    """The greedy completion and the replica that answered it."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
    return raw.parse().choices[0].text, raw.headers["x-specdecode-replica"]


def test_requests_reach_both_replicas_and_equal_a_solo_generate(client, solo):
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: _complete(client, p), PROMPTS))
    assert len({replica for _, replica in answers}) == 2
    for prompt, (text, _) in zip(PROMPTS, answers):
        assert text == solo(prompt, 24)


def test_a_shared_prefix_keeps_to_one_replica(client, solo):
    questions = ["Is the museum open on Mondays?", "Can I bring my dog on the train?", "Where do I pick up my keys?",
                 "Do you sell tickets for the ferry?", "Is breakfast included?", "Can I change my flight?"]
    answers = [_complete(client, SHARED + q, 16) for q in questions]  # one at a time: the load stays balanced
    assert len({replica for _, replica in answers}) == 1  # by chance with 2 replicas: 1 in 32
    assert answers[0][0] == solo(SHARED + questions[0], 16)


def test_a_stream_through_the_proxy_equals_the_plain_answer(client):
    messages = [{"role": "user", "content": "Name two rivers in Europe."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 20


def test_bad_input_gets_the_servers_error(cluster, client):
    request = urllib.request.Request(cluster["url"] + "/v1/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json", **AUTH})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code == 400 and "not valid JSON" in json.loads(err.value.read())["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="is not served here"):
        client.completions.create(model="other", prompt="hi", max_tokens=2)


def test_without_the_key_the_replicas_and_the_ingress_answer_401(cluster):
    for path in ("/v1/models", "/metrics"):  # a replica's route, and the ingress's own
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(cluster["url"] + path, timeout=60)
        assert err.value.code == 401 and json.loads(err.value.read())["error"]["code"] == "invalid_api_key"
    with urllib.request.urlopen(cluster["url"] + "/health", timeout=60) as r:
        assert r.status == 200


def test_both_replicas_metrics_in_one_view(cluster, client):
    from prometheus_client.parser import text_string_to_metric_families

    # Both replicas answer something here (the test does not count on earlier tests, which may have run on
    # another cluster: a worker that switches modules in between sets the module's fixtures up again).
    served: set[str] = set()
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            served |= {replica for _, replica in pool.map(lambda p: _complete(client, p, 8), PROMPTS)}
            if len(served) == 2:
                break
    assert len(served) == 2
    # Every replica pushes every METRICS_PUSH_S; on a loaded machine a push can come late, so wait for both.
    deadline = time.monotonic() + 30 * METRICS_PUSH_S
    while True:
        with urllib.request.urlopen(urllib.request.Request(cluster["url"] + "/metrics", headers=AUTH), timeout=60) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        generated = {s.labels["replica"]: s.value for s in families["vllm:generation_tokens"].samples}
        if len(generated) == 2 or time.monotonic() > deadline:
            break
        time.sleep(METRICS_PUSH_S)
    assert len(generated) == 2 and all(v > 0 for v in generated.values())
    drafted = sum(s.value for s in families["vllm:spec_decode_num_draft_tokens"].samples)
    accepted = sum(s.value for s in families["vllm:spec_decode_num_accepted_tokens"].samples)
    assert drafted > 0 and 0 <= accepted <= drafted
    assert {s.labels["replica"] for s in families["vllm:num_requests_running"].samples} == set(generated)


def test_a_client_that_goes_away_frees_its_replicas_slot(cluster, client):
    from prometheus_client.parser import text_string_to_metric_families

    def running(replica: str) -> float:
        """The requests ``replica`` decodes, as its latest push says. Only its own series: under CI's load Ray may
        replace a replica whose health check timed out, and the one replaced keeps showing its last push (a request
        running) in the merged view for METRICS_STALE_S (clean-clone CI at 28410cc read 2)."""
        with urllib.request.urlopen(urllib.request.Request(cluster["url"] + "/metrics", headers=AUTH), timeout=60) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        return sum(s.value for s in families["vllm:num_requests_running"].samples if s.labels["replica"] == replica)

    # Counting never reaches end-of-sequence (a code prompt did after ~160 tokens, under a second: finished before
    # the replica's next metrics push), so the request is still running when /metrics is read. Under CI's load a
    # push can still come after its ~900 tokens (n-gram drafts counting well): then a new request is tried.
    for attempt in range(3):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
                                                          max_tokens=900, temperature=0, stream=True)
        replica, stream = raw.headers["x-specdecode-replica"], raw.parse()
        chunks = iter(stream)
        next(chunks)
        deadline = time.monotonic() + 30  # the replicas push every METRICS_PUSH_S: earlier requests may still show
        while running(replica) != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        if running(replica) == 1:
            break
        assert sum(1 for _ in chunks) > 0, "the request ended without finishing its answer"  # it ran to its end
    assert running(replica) == 1
    stream.close()  # ~900 tokens would take several seconds more
    deadline = time.monotonic() + 10
    while running(replica) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running(replica) == 0


def test_a_replica_that_cannot_load_fails_its_deployment(cluster, tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    app = build_application(serve_flags(_flags(missing)), replicas=1, cpus_per_replica=0.5)
    with pytest.raises(DeploymentError, match=r"EngineServer failed: FileNotFoundError: .*no-such-model\.gguf"):
        run_application(app, name="broken", route_prefix="/broken")
    serve.delete("broken")


@pytest.mark.slow
def test_a_replica_killed_under_load(cluster, client, solo):
    started = threading.Semaphore(0)  # released by each stream's first chunk

    def stream(prompt: str) -> str:
        chunks, text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=120, temperature=0,
                                                 stream=True), []
        for c in chunks:
            if c.choices:
                if not text:
                    started.release()
                text.append(c.choices[0].text)
        return "".join(text)

    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == "serve" and "EngineServer" in a["name"]]
    assert len(replicas) == 2
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, p) for p in PROMPTS]
        for _ in range(4):  # both replicas stream two requests each; two more wait
            assert started.acquire(timeout=120)
        ray.kill(ray.get_actor(replicas[0]["name"], namespace="serve"), no_restart=True)
        outcomes = []
        for prompt, future in zip(PROMPTS, futures):
            try:
                outcomes.append(future.result(timeout=240) == solo(prompt, 120))
            except openai.APIError as exc:  # a stream cut after its first tokens
                assert "died mid-stream; the answer is incomplete" in str(exc), exc
                outcomes.append("failed")
    # the killed replica's two streams fail with the error; the rest (a waiting one retried) answer in full
    assert outcomes.count("failed") == 2 and outcomes.count(True) == 4, outcomes
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # Ray replaces the replica
        status = serve.status().applications[APP_NAME]
        if status.status == "RUNNING" and status.deployments["EngineServer"].replica_states.get("RUNNING") == 2:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the killed replica was not replaced: {serve.status().applications[APP_NAME]}")
    assert _complete(client, PROMPTS[0])[0] == solo(PROMPTS[0], 24)


def test_shutdown_leaves_no_ray_process(cluster):
    session = cluster["session"]
    assert _session_processes(session), "the test cannot see the cluster's processes"
    serve.shutdown()
    ray.shutdown()
    deadline = time.monotonic() + 30
    while _session_processes(session) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _session_processes(session) == []


@pytest.mark.slow
def test_the_serve_ray_command_serves_and_stops_cleanly(smollm2_path, solo, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "serve", "--ray", "--replicas", "1", "--port",
                             str(port), *_flags(smollm2_path)], stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)
        deadline = time.monotonic() + 300
        while "serving on http://" not in log.read_text():  # the command says so once the app is up
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(1)
        text = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0)
        assert text.choices[0].text == solo(PROMPTS[1], 12)
        children = _descendants(proc.pid)
        assert children, "the command started no Ray processes"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()
        deadline = time.monotonic() + 30
        while _alive(children) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _alive(children) == []
    finally:
        if proc.poll() is None:
            proc.kill()
