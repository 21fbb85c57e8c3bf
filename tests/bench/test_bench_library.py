"""The library reference of bench-serve (bench/library.py) on a tiny model: it serves the requests it is
given, greedy, at most `level` at a time, each answer equal to a solo `Engine`'s, and says how fast."""

from __future__ import annotations

from specdecode.bench.library import Library
from specdecode.engine import Engine
from specdecode.prompts import Prompt
from specdecode.target import TargetConfig

PROMPTS = [Prompt("a", "chat", "tell me about rivers"), Prompt("b", "chat", "count to ten", prediction="one two three"),
           Prompt("c", "chat", None, ({"role": "user", "content": "hello there"},))]


def test_the_library_serves_each_request_as_a_solo_engine_would(tiny_model_dirs):
    library = Library(TargetConfig(str(tiny_model_dirs[0]), dtype="float32", device="cpu"), lambda line: None)
    requests = library.requests(PROMPTS, 5)
    ids = [r["prompt"] for r in requests]
    assert ids[3] == ids[0] and len(ids) == 5  # cycles through the prompts, as the servers' requests do
    assert [r["prediction"] for r in requests] == [None, "one two three", None, None, "one two three"]
    solo = Engine(library.target.model, library.target.tokenizer)
    want = [solo.generate(p, max_new_tokens=12).text for p in ids]
    for method, level in (("none", 1), ("none", 2), ("ngram:adaptive", 2), ("ngram:3", 1)):
        tokens_per_s, texts = library.tokens_per_s(method, level, requests, max_tokens=12)
        assert tokens_per_s > 0 and texts == want, (method, level)
        assert library._engines[(method, level)].scheduler.config.max_running == level
    engine = library._engines[("none", 1)]
    library.tokens_per_s("none", 1, requests, max_tokens=12, fresh=True)
    assert library._engines[("none", 1)] is not engine  # a fresh engine: nothing learned from earlier runs


def test_stored_prompts_come_from_the_prefix_cache_as_on_a_server(tiny_model_dirs):
    # bench-serve sends every server each request for one token before its timed runs (the prompts then in the
    # server's prefix cache, which serve keeps by default); the library's reference reads them alike.
    library = Library(TargetConfig(str(tiny_model_dirs[0]), dtype="float32", device="cpu"), lambda line: None)
    long = Prompt("d", "chat", "rivers and lakes " * 100)  # (the cache keeps whole blocks of a prompt: 256 tokens here)
    requests = library.requests([*PROMPTS, long], 4)
    _, cold = library.tokens_per_s("ngram:adaptive", 2, requests, max_tokens=12, fresh=True)
    library.store_prompts("ngram:adaptive", 2, requests, fresh=True)
    _, stored = library.tokens_per_s("ngram:adaptive", 2, requests, max_tokens=12)
    engine = library._engines[("ngram:adaptive", 2)]
    assert engine.memory.prefix_bytes > 0 and stored == cold
