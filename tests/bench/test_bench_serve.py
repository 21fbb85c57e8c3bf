"""bench-serve's pieces that need no server: method and level parsing, percentiles, a level's summary."""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import replace

import pytest

from specdecode.bench.load import RequestResult, percentile, summarize
from specdecode.bench import serve_command
from specdecode.bench.serve_command import BenchServeConfig, _levels, _methods


def test_methods_always_include_plain_decoding_and_name_bad_ones():
    assert _methods("ngram:adaptive,eagle:4") == ["none", "ngram:adaptive", "eagle:4"]
    assert _methods("none,medusa:adaptive") == ["none", "medusa:adaptive"]
    for bad in ("ngram", "none:4", "draft:4", "layerskip:adaptive"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad.split(":")[0]):
            _methods(bad)


def test_the_llamacpp_peer_is_a_method_and_needs_its_server_and_a_gguf(monkeypatch, tmp_path):
    assert _methods("llamacpp,ngram:adaptive") == ["none", "llamacpp", "ngram:adaptive"]
    config = BenchServeConfig(model=str(tmp_path / "model-folder"), threads=1)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"needs llama-cpp-python's server: pip install 'llama-cpp-python\[server\]'"):
        serve_command._peer_command("llamacpp", config, 4)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    with pytest.raises(ValueError, match="needs a GGUF model"):
        serve_command._peer_command("llamacpp", config, 4)


def test_the_llamacpp_server_peer_is_refused_with_the_build_command_and_runs_its_slots(monkeypatch, tmp_path):
    from specdecode.bench import llamacpp_tools

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    assert _methods("llamacpp-server") == ["none", "llamacpp-server"]
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    config = BenchServeConfig(model=str(gguf), threads=2)
    with pytest.raises(llamacpp_tools.PeerMissing, match="specdecode peers build"):
        serve_command._peer_command("llamacpp-server", config, 4)
    binary = llamacpp_tools.build_dir() / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    cmd = serve_command._peer_command("llamacpp-server", config, 4)
    assert cmd[0] == str(binary) and cmd[cmd.index("-m") + 1] == str(gguf) and cmd[cmd.index("--port") + 1] == "{port}"
    assert cmd[cmd.index("--parallel") + 1] == "4" and cmd[cmd.index("-t") + 1] == "2"
    assert cmd[cmd.index("-c") + 1] == str(4 * 4096)  # each slot gets the context
    assert _methods("llamacpp-server:t1,llamacpp-server") == ["none", "llamacpp-server:t1", "llamacpp-server"]
    own = serve_command._peer_command("llamacpp-server:t1", config, 4)  # its own thread count, not --threads
    assert own[own.index("-t") + 1] == "1"
    monkeypatch.setattr(serve_command, "server_threads", lambda: 7)  # a machine of 8 cores
    unset = serve_command._peer_command("llamacpp-server", replace(config, threads=None), 4)
    assert unset[unset.index("-t") + 1] == "7"  # by default as many threads as our server runs
    for bad in ("llamacpp-server:1", "llamacpp-server:t0", "llamacpp:tx"):
        with pytest.raises(argparse.ArgumentTypeError, match="takes its thread count"):
            _methods(bad)


def test_ray_methods_name_their_replicas_and_share_the_cores():
    assert _methods("ray2:none,ray1:ngram:adaptive") == ["none", "ray2:none", "ray1:ngram:adaptive"]
    for bad in ("ray2", "ray0:none", "rayx:none", "ray2:ngram", "ray2:llamacpp"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad):
            _methods(bad)
    config = BenchServeConfig(model="m", threads=2)
    flags = serve_command._server_flags("ray2:ngram:adaptive", config, 4)
    assert flags[flags.index("--drafter") + 1] == "ngram" and flags[flags.index("--gamma") + 1] == "adaptive"
    assert flags[flags.index("--replicas") + 1] == "2" and flags[flags.index("--cpus-per-replica") + 1] == "1"
    assert "--threads" not in flags and "--ray" in flags
    flags = serve_command._server_flags("ray3:none", config, 4)
    assert 3 * float(flags[flags.index("--cpus-per-replica") + 1]) <= 2  # rounded down, never above the cores
    assert "--ray" not in serve_command._server_flags("none", config, 4)


def test_levels():
    assert _levels("1,2,4,8") == [1, 2, 4, 8]
    for bad in ("0,1", "a", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            _levels(bad)


def test_percentile_interpolates_and_handles_no_values():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_summary_counts_tokens_of_successful_requests_only():
    results = [RequestResult(0, "ab", 10, 0.2, [0.05, 0.07], 1.0), RequestResult(1, "c", 6, 0.4, [0.06], 0.9),
               RequestResult(2, error="HTTP 429: full")]
    s = summarize(results, wall_s=2.0)
    assert (s["requests"], s["errors"], s["tokens"], s["tokens_per_s"]) == (3, 1, 16, 8.0)
    assert s["ttft_p50_s"] == pytest.approx(0.3) and s["itl_p50_s"] == pytest.approx(0.06)


def test_a_learning_drafter_gets_a_cold_and_a_warm_row_outside_a_workload():
    # Drift fixed: with --repeats, a learning drafter's later repeats drafted from its earlier answers to the same
    # requests, and the one row mixed cold and warm (454 tok/s in a second round, 276 in the first).
    methods = _methods("ngram:adaptive,suffix:adaptive,auto:adaptive")
    config = BenchServeConfig(model="m", methods=methods)
    assert serve_command._rows(config) == ["none", "ngram:adaptive", "suffix:adaptive cold", "suffix:adaptive warm",
                                           "auto:adaptive cold", "auto:adaptive warm"]
    assert serve_command._rows(replace(config, workload="agentic")) == methods  # each run afresh: cold only


def test_the_paired_ratio_is_the_median_of_each_repeats_own_ratio():
    # Three repeats, plain decoding's second on a fast minute of the machine: the medians' ratio is 110 / 120 = 0.92,
    # while the method was ahead in two of three repeats (1.1, 0.5, 1.05 -> 1.05 paired).
    def run(tps: float) -> dict:
        return {"tokens_per_s": tps, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "itl_p50_s": 0.01, "itl_p99_s": 0.02,
                "errors": 0}
    plain, auto = [run(100.0), run(220.0), run(120.0)], [run(110.0), run(110.0), run(126.0)]
    config = BenchServeConfig(model="m", methods=["none", "ngram:adaptive"], repeats=3)
    runs = {("none", 1): plain, ("ngram:adaptive", 1): auto}
    texts = {key: [["a"]] * 3 for key in runs}
    rows = {r["method"]: r for r in serve_command._report(config, [1], runs, texts)["summary"]["rows"]}
    assert rows["ngram:adaptive"]["vs_plain"] == pytest.approx(110.0 / 120.0, abs=1e-4)
    assert rows["ngram:adaptive"]["vs_plain_paired"] == pytest.approx(1.05)
    assert rows["none"]["vs_plain_paired"] == 1.0


def test_a_level_where_every_request_failed_is_reported_with_dashes(tmp_path):
    # Drift fixed: plain decoding that gave 0 tokens/s (every request an error) left vs_plain None, and report.md's
    # table formatted None as a number: the whole report was lost at its last step.
    failed = {"tokens_per_s": 0.0, "ttft_p50_s": None, "ttft_p99_s": None, "itl_p50_s": None, "itl_p99_s": None,
              "errors": 4}
    ok = {"tokens_per_s": 90.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "itl_p50_s": 0.01, "itl_p99_s": 0.02, "errors": 0}
    config = BenchServeConfig(model="m", methods=["none", "ngram:adaptive"])
    runs = {("none", 1): [failed], ("ngram:adaptive", 1): [ok]}
    texts = {key: [["a"]] for key in runs}
    report = serve_command._report(config, [1], runs, texts)
    lines = []
    serve_command._print_table(report, lines.append)
    serve_command._write(report, tmp_path, lambda _line: None)
    table = (tmp_path / "report.md").read_text()
    ngram = next(line for line in table.splitlines() if line.startswith("| ngram:adaptive |"))
    assert ngram.startswith("| ngram:adaptive | 1 | 90.0 | - | - | - | - | - | 100 ms | 10 ms | 20 ms |")
    assert "- | - | - | - |" in next(line for line in table.splitlines() if line.startswith("| none |"))
    assert lines[1].split()[:4] == ["none", "1", "0.0", "-"]
