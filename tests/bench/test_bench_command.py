"""`specdecode bench` end to end on tiny random-weight HF folders: JSON schema, identity, report, plots."""

from __future__ import annotations

import json
import re

import pytest
import torch

from specdecode.bench import methods as bench_methods
from specdecode.bench.report import matplotlib_available
from specdecode.bench.runner import RELEVANT_CPU_FLAGS
from specdecode.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _restore_threads():
    # --threads 1 keeps the tiny runs fast on a shared machine; torch's setting is process-wide.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def prompt_file(tmp_path):
    lines = [
        {"id": "p1", "category": "alpha", "prompt": "the cat sat on the mat and the dog ran to the park"},
        {"id": "p2", "category": "alpha", "messages": [{"role": "system", "content": "be good"},
                                                       {"role": "user", "content": "write code def return"}]},
        {"id": "p3", "category": "beta", "prompt": "one two three four five six one two three four"},
        {"id": "p4", "category": "beta", "prompt": "red blue green red blue green red"},
        {"id": "p5", "category": "gamma", "prompt": "not run: --categories leaves it out"},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def _base_args(models, prompt_file):
    target, draft = models
    return ["bench", "--model", str(target), "--dtype", "float32", "--threads", "1", "--prompts", str(prompt_file),
            "--categories", "alpha,beta", "--max-new-tokens", "12", "--no-progress"]


def test_plain_decoding_is_our_first_family_and_a_failure_of_it_fails_the_run():
    from specdecode.bench.command import _gates
    from specdecode.drafters import registry

    assert bench_methods.OUR_FAMILIES == ("none", *registry.names(), bench_methods.PREDICTION_FAMILY)
    assert _gates("none") and _gates("ngram") and not _gates("eagle") and not _gates("hf")


def test_bench_end_to_end(tiny_model_dirs, prompt_file, tmp_path, capsys):
    out_json, report = tmp_path / "bench.json", tmp_path / "report"
    args = _base_args(tiny_model_dirs, prompt_file) + [
        "--draft-model", str(tiny_model_dirs[1]), "--draft-quant", "int8", "--skip-layers", "1,2", "--gammas", "2",
        "--cost-curve", "3", "--methods", "none,ngram,draft,layerskip,hf,hf-assisted,hf-lookup,llamacpp,llamacpp-lookup",
        "--json", str(out_json)]
    if matplotlib_available():
        args += ["--report", str(report)]
    assert main(args) == 0
    captured = capsys.readouterr()
    doc = json.loads(out_json.read_text())

    ours = ["none", "ngram:g2", "ngram:agreement", "draft:g2", "draft:agreement", "layerskip:g2", "layerskip:agreement"]
    names = [m["name"] for m in doc["methods"]]
    assert names[:len(ours)] == ours
    assert set(names[len(ours):]) == {"hf", "hf-assisted", "hf-lookup"}  # llama.cpp is skipped (see below)
    for m in doc["methods"]:
        assert m["status"] == "ok", m
        o = m["overall"]
        for key in ("tokens_per_s", "speedup_vs_hf", "speedup_vs_none"):
            assert isinstance(o[key], float) and o[key] > 0, (m["name"], key)
        assert "mean_accepted_length" in o
        assert set(m["by_category"]) == {"alpha", "beta"}
        assert m["by_category"]["alpha"]["prompts"] == 2 and o["prompts"] == 4
    by_name = {m["name"]: m for m in doc["methods"]}
    assert by_name["none"]["overall"]["speedup_vs_none"] == 1.0
    assert by_name["hf"]["overall"]["speedup_vs_hf"] == 1.0
    assert by_name["ngram:g2"]["overall"]["mean_accepted_length"] >= 1.0
    assert by_name["hf"]["overall"]["mean_accepted_length"] is None
    assert by_name["layerskip:g2"]["params"]["skip_layers"] == [1, 2]
    assert by_name["hf-lookup"]["params"]["prompt_lookup_num_tokens"] == 2
    assert not any(m["given_predictions"] for m in doc["methods"])  # only auto and the prediction family get them

    # greedy: every speculative method of ours on every prompt is compared with none, and all agree
    assert doc["identity_comparisons"] == (len(ours) - 1) * 4
    assert doc["identical_outputs"] == doc["identity_comparisons"]
    assert doc["identity_mismatches"] == []
    assert doc["prompts"]["count"] == 4 and doc["prompts"]["categories"] == ["alpha", "beta"]
    assert len(doc["samples"]) == len(doc["methods"]) * 4
    assert doc["memory"]["peak_rss_mb"] > 0
    assert by_name["none"]["memory_mb"]["target_weights"] > 0 and by_name["none"]["memory_mb"]["target_kv"] > 0
    assert by_name["none"]["memory_mb"]["draft_weights"] == 0 < by_name["draft:g2"]["memory_mb"]["draft_weights"]
    assert by_name["layerskip:g2"]["memory_mb"]["draft_kv"] == 0  # drafts in the target's own cache
    assert by_name["hf"]["memory_mb"] is None
    # what each method ran on: --dtype float32 applies to the peers too; only our draft model is quantized
    assert doc["config"]["torch_dtype"] == doc["config"]["peer_dtype"] == "float32"
    runs_on = {m["name"]: (m["kernel"], m["dtype"], m["draft_kernel"], m["draft_dtype"]) for m in doc["methods"]}
    ours = (doc["config"]["linear_kernel"], "float32")
    assert runs_on["none"] == runs_on["ngram:g2"] == runs_on["layerskip:g2"] == (*ours, None, None)
    assert runs_on["draft:g2"] == (*ours, "int8", "float32")
    assert runs_on["hf"] == runs_on["hf-lookup"] == ("transformers", "float32", None, None)
    assert runs_on["hf-assisted"] == ("transformers", "float32", "transformers", "float32")
    assert set(doc["environment"]["cpu_flags"]) <= set(RELEVANT_CPU_FLAGS) and doc["environment"]["cpu_family"]
    # the verification cost curve of the target and of the draft model, k = 0..3
    assert [len(c["v"]) for c in doc["cost_curves"]] == [4, 4] and all(c["v"][0] == 1.0 for c in doc["cost_curves"])
    assert all(ms > 0 for c in doc["cost_curves"] for ms in c["verify_ms"])
    assert "verification cost v(k) of" in captured.out
    assert {s["name"] for s in doc["skipped"]} == {"llamacpp", "llamacpp-lookup"}
    if bench_methods.llamacpp_available():  # installed, but these tiny models are HF folders, not GGUF files
        assert "note: skipped llamacpp, llamacpp-lookup: needs a GGUF model" in captured.out
    else:
        assert "note: llama-cpp-python is not installed: skipped llamacpp, llamacpp-lookup" in captured.out

    # the table on stdout
    assert re.search(r"^ngram:g2\s+\d", captured.out, re.M)
    assert f"greedy outputs identical to 'none': {doc['identical_outputs']}/{doc['identity_comparisons']}" in captured.out

    if matplotlib_available():
        assert json.loads((report / "results.json").read_text()) == doc
        for name in ("speedup_by_category.png", "acceptance_by_position.png", "gamma_sweep.png", "verification_cost.png"):
            data = (report / name).read_bytes()
            assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
        md = (report / "report.md").read_text()
        # every overall figure in the report is the JSON's value, spelled the same way
        for m in doc["methods"]:
            o = m["overall"]
            row = next(line for line in md.splitlines() if line.startswith(f"| `{m['name']}` |"))
            cells = [c.strip() for c in row.strip("|").split("|")]
            spelled = lambda v: "-" if v is None else json.dumps(v)  # noqa: E731
            assert cells[1] == spelled(o["tokens_per_s"])
            assert cells[2] == f"{spelled(o['speedup_vs_hf'])} [{spelled(o['speedup_vs_hf_min'])}, {spelled(o['speedup_vs_hf_max'])}]"
            assert cells[3].startswith(spelled(o["speedup_vs_none"]) + " [")
            assert cells[4] == spelled(o["mean_accepted_length"])
            assert cells[5] == spelled(o["acceptance_rate"])
            assert cells[7] == spelled(o["predicted_speedup"])
        assert f"**{doc['identical_outputs']} / {doc['identity_comparisons']}**" in md
        assert f"- machine: {doc['environment']['cpu_model']} ({doc['environment']['cpu_family']};" in md
        assert next(line for line in md.splitlines() if line.startswith("| `draft:g2` |")).endswith(
            f"| {ours[0]} float32; draft int8 float32 |")


def test_tree_methods_run_report_accepted_length_by_size_and_skip_confidence(tiny_model_dirs, prompt_file, tmp_path,
                                                                            capsys):
    out_json, report = tmp_path / "bench.json", tmp_path / "report"
    args = _base_args(tiny_model_dirs, prompt_file) + [
        "--draft-model", str(tiny_model_dirs[1]), "--methods", "none,ngram,ngram-tree,draft-tree", "--gammas",
        "4,confidence", "--tree-width", "3", "--cost-curve", "0", "--json", str(out_json)]
    if matplotlib_available():
        args += ["--report", str(report)]
    assert main(args) == 0
    doc = json.loads(out_json.read_text())
    by_name = {m["name"]: m for m in doc["methods"]}
    assert {"ngram-tree:g4", "ngram-tree:agreement", "draft-tree:g4", "draft-tree:agreement"} <= set(by_name)
    assert {s["name"] for s in doc["skipped"]} >= {"ngram-tree:confidence", "draft-tree:confidence"}
    assert by_name["draft-tree:g4"]["params"]["tree_width"] == 3
    assert by_name["draft-tree:g4"]["overall"]["tree_steps"] > 0  # a 3-wide draft model tree branches
    budget = by_name["draft-tree:g4"]["overall"]["accepted_length_by_budget"]
    assert len(budget) <= 5 and all(v is None or v >= 1.0 for v in budget)
    assert doc["identical_outputs"] == doc["identity_comparisons"] > 0
    if matplotlib_available():
        md = (report / "report.md").read_text()
        assert "## Accepted length by draft size" in md and "| `draft-tree:g4` |" in md
        assert (report / "accepted_length_by_budget.png").read_bytes().startswith(PNG_MAGIC)


def test_every_controller_runs_and_record_steps_writes_valid_jsonl(tiny_model_dirs, prompt_file, tmp_path):
    from specdecode.control import GAMMA_POLICIES
    from specdecode.control.records import read_records

    out_json, steps = tmp_path / "bench.json", tmp_path / "steps.jsonl"
    args = _base_args(tiny_model_dirs, prompt_file) + [
        "--draft-model", str(tiny_model_dirs[1]), "--skip-layers", "1,2", "--methods", "none,ngram,draft,layerskip",
        "--gammas", "2,cost,confidence,adaptive", "--limit", "1", "--json", str(out_json), "--record-steps", str(steps)]
    assert main(args) == 0
    doc = json.loads(out_json.read_text())
    controllers = [g for g in GAMMA_POLICIES]
    want = ["none"] + [f"{f}:{g}" for f in ("ngram", "draft", "layerskip") for g in ["g2", *controllers[1:], "agreement"]]
    assert sorted(m["name"] for m in doc["methods"]) == sorted(want)
    assert doc["identical_outputs"] == doc["identity_comparisons"] == (len(want) - 1) * 2
    assert doc["config"]["record_steps"] == str(steps)
    by_name = {m["name"]: m for m in doc["methods"]}
    assert by_name["layerskip:confidence"]["params"] == {"skip_layers": [1, 2], "gamma_max": 8, "controller_file": None}
    for m in doc["methods"]:
        if m["name"] != "none":
            # a share of the wall time (tiny models make steps so cheap that only the range is checkable here)
            assert 0 <= m["overall"]["control_share"] < 1, m["name"]

    lines = read_records([steps])  # every line passes the checks fit-controller makes
    timed = {(s["method"], s["prompt_id"]) for s in doc["samples"] if s["method"] != "none"}
    assert {(line["method"], line["prompt_id"]) for line in lines} <= timed
    assert {line["drafter"] for line in lines} == {"ngram", "draft", "layerskip"}
    for line in lines:
        assert line["model"] == str(tiny_model_dirs[0]) and line["kv"] == "float32"
        assert len(line["signals"]) == line["drafted"]
        assert line["signal_names"] == (["match_len", "occurrences", "agree"] if line["drafter"] == "ngram"
                                        else ["top1", "entropy"])


def test_a_learning_drafter_is_warmed_up_then_forgets_the_warm_up(tiny_model_dirs, prompt_file, tmp_path,
                                                                    monkeypatch):
    # Skipping its warm-up left first-call costs (a grammar compiler's start) in its first timed prompt; running it
    # without forgetting would let that prompt's timed run draft its own output.
    from specdecode.batch.executor import BatchEngine

    forgot = []
    real = BatchEngine.forget_learned

    def forget(engine):
        forgot.append(engine.learned[0])
        real(engine)
        forgot.append(engine.learned[0])

    monkeypatch.setattr(BatchEngine, "forget_learned", forget)
    args = _base_args(tiny_model_dirs, prompt_file) + ["--methods", "none,ngram,suffix", "--gammas", "2",
                                                       "--limit", "1", "--json", str(tmp_path / "bench.json")]
    assert main(args) == 0
    assert forgot == [1, 0] * 2  # suffix:g2 and suffix:agreement alone: each had learnt its warm-up, then nothing


def test_auto_drafts_with_the_runs_draft_model_and_its_records_name_its_controller_entry(tiny_model_dirs, prompt_file,
                                                                                          tmp_path):
    from specdecode.control.records import read_records

    out_json, steps = tmp_path / "bench.json", tmp_path / "steps.jsonl"
    args = _base_args(tiny_model_dirs, prompt_file) + [  # auto the only user of the draft model: it is loaded
        "--draft-model", str(tiny_model_dirs[1]), "--methods", "none,auto", "--gammas", "2", "--limit", "1",
        "--json", str(out_json), "--record-steps", str(steps)]
    assert main(args) == 0
    doc = json.loads(out_json.read_text())
    by_name = {m["name"]: m for m in doc["methods"]}
    assert by_name["auto:g2"]["params"]["draft_model"] == str(tiny_model_dirs[1])
    assert doc["identical_outputs"] == doc["identity_comparisons"] > 0
    lines = read_records([steps])
    assert lines and {line["drafter"] for line in lines} == {"auto+draft"}  # the drafter's name, not the family's
    assert all(line["signal_names"] == ["top1", "entropy"] for line in lines)


def test_sampled_run_skips_the_identity_check(tiny_model_dirs, prompt_file, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    args = _base_args(tiny_model_dirs, prompt_file) + ["--methods", "ngram,hf", "--gammas", "2", "--limit", "1",
                                                       "--temperature", "0.8", "--json", str(out_json)]
    assert main(args) == 0
    doc = json.loads(out_json.read_text())
    assert [m["name"] for m in doc["methods"]] == ["none", "ngram:g2", "ngram:agreement", "hf"]  # none always runs
    assert doc["identical_outputs"] is None and doc["identity_comparisons"] is None
    assert "temperature" in doc["identity_note"]
    assert any("token-identity check against 'none' is skipped" in n for n in doc["notes"])
    assert doc["prompts"]["count"] == 2


def test_a_peer_that_fails_is_reported_not_hidden(tiny_model_dirs, prompt_file, tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("transformers exploded")

    monkeypatch.setattr("specdecode.bench.runner.build_hf_model", broken)
    out_json = tmp_path / "bench.json"
    args = _base_args(tiny_model_dirs, prompt_file) + ["--methods", "none,hf,hf-lookup", "--limit", "1",
                                                       "--json", str(out_json)]
    assert main(args) == 0  # a peer failing does not fail the run ...
    doc = json.loads(out_json.read_text())
    failed = {f["name"]: f["error"] for f in doc["failed"]}
    assert set(failed) == {"hf", "hf-lookup"} and "transformers exploded" in failed["hf"]
    entry = next(m for m in doc["methods"] if m["name"] == "hf")
    assert entry["status"] == "failed" and entry["overall"]["tokens_per_s"] is None
    assert doc["methods"][0]["overall"]["speedup_vs_hf"] is None
    assert "FAILED hf: RuntimeError: transformers exploded" in capsys.readouterr().out  # ... but is shown


def test_a_peer_that_fails_mid_run_is_dropped_and_reported(tiny_model_dirs, prompt_file, tmp_path, capsys, monkeypatch):
    real = bench_methods.hf_method

    def flaky(*args, **kwargs):
        method = real(*args, **kwargs)
        calls = {"n": 0}
        run = method.run

        def run_then_fail(ids, seed):
            calls["n"] += 1
            if calls["n"] > 2:  # warm-up and the first prompt work
                raise RuntimeError("out of luck")
            return run(ids, seed)

        method.run = run_then_fail
        return method

    monkeypatch.setattr("specdecode.bench.runner.hf_method", flaky)
    out_json = tmp_path / "bench.json"
    assert main(_base_args(tiny_model_dirs, prompt_file) + ["--methods", "none,hf", "--json", str(out_json)]) == 0
    doc = json.loads(out_json.read_text())
    hf = next(m for m in doc["methods"] if m["name"] == "hf")
    assert hf["status"] == "failed" and "out of luck" in hf["error"]
    assert hf["overall"]["prompts"] == 1
    assert "!! hf FAILED on" in capsys.readouterr().err


def test_usage_errors(tiny_model_dirs, prompt_file, capsys):
    base = _base_args(tiny_model_dirs, prompt_file)
    assert main(base + ["--methods", "draft"]) == 2
    assert "need --draft-model" in capsys.readouterr().err
    assert main(base + ["--categories", "nope"]) == 2
    assert "no prompts in ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--methods", "none,warp-drive"])
    assert "unknown method families ['warp-drive']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--gammas", "0"])
    assert "gamma must be in 1..64" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--gammas", "4,fastest"])
    assert "expected an integer >= 0 or one of agreement, confidence, cost, adaptive, got 'fastest'" in capsys.readouterr().err
    assert main(base + ["--gammas", "confidence", "--controller-file", str(prompt_file)]) == 2
    assert "is not valid JSON (truncated or corrupt?)" in capsys.readouterr().err
    assert main(base + ["--draft-weights", "q8_0"]) == 2
    assert "--draft-weights q8_0 needs --draft-model" in capsys.readouterr().err
    assert main(base + ["--draft-model", str(tiny_model_dirs[1]), "--draft-quant", "int8", "--draft-weights", "q8_0"]) == 2
    assert "--draft-quant int8 and --draft-weights both" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--weights", "auto,q3_k"])
    assert ("expected a comma list of auto, blocks, bf16, q8_0, q4_0, q4_1, q4_1+head, q4_0+head, got 'auto,q3_k'"
            in capsys.readouterr().err)
    assert main(base + ["--weights", "q4_1"]) == 2  # a float32 model: the projections would run on torch
    assert "--weights q4_1 needs one of our kernels" in capsys.readouterr().err


def test_report_without_matplotlib_says_so_before_running(tiny_model_dirs, prompt_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("specdecode.bench.report.matplotlib_available", lambda: False)
    assert main(_base_args(tiny_model_dirs, prompt_file) + ["--report", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "--report needs matplotlib" in err and "pip install 'specdecode[bench]'" in err
    assert "loading" not in err and not (tmp_path / "r").exists()


def test_missing_transformers_skips_the_hf_peers_with_one_note(tiny_model_dirs, prompt_file, tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.setattr("specdecode.bench.runner.transformers_available", lambda: False)
    out_json = tmp_path / "bench.json"
    args = _base_args(tiny_model_dirs, prompt_file) + ["--methods", "none,hf,hf-lookup", "--limit", "1",
                                                       "--json", str(out_json)]
    assert main(args) == 0
    doc = json.loads(out_json.read_text())
    assert [m["name"] for m in doc["methods"]] == ["none"] and doc["failed"] == []
    assert {s["name"] for s in doc["skipped"]} == {"hf", "hf-lookup"}
    assert "note: transformers is not installed: skipped hf, hf-lookup" in capsys.readouterr().out


def test_kv_flags_pass_through_and_memory_per_token_is_reported(tiny_model_dirs, prompt_file, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    args = _base_args(tiny_model_dirs, prompt_file) + [
        "--draft-model", str(tiny_model_dirs[1]), "--methods", "none,ngram,draft", "--gammas", "3",
        "--kv-dtype", "int8", "--draft-kv-dtype", "int4", "--kv-window", "40", "--kv-sinks", "2",
        "--prefix-cache", "on", "--kv-budget", "8M", "--max-new-tokens", "80", "--json", str(out_json)]
    assert main(args) == 0
    captured = capsys.readouterr()
    doc = json.loads(out_json.read_text())
    c = doc["config"]
    assert (c["kv_dtype"], c["draft_kv_dtype"], c["kv_window"], c["kv_sinks"], c["kv_budget"], c["prefix_cache"]) == \
        ("int8", "int4", 40, 2, 8 * 2 ** 20, True)
    assert c["linear"] == "auto" and c["linear_kernel"] == "torch"  # auto keeps a float32 model on F.linear
    assert doc["identical_outputs"] == doc["identity_comparisons"] > 0  # lossless under the same compression
    by_name = {m["name"]: m["overall"] for m in doc["methods"]}
    fp32_per_token = 2 * 4 * 2 * 16 * 4
    for name in ("none", "ngram:g3", "draft:g3"):  # 90-odd tokens: past the first quantized group and eviction
        assert 0 < by_name[name]["kv_bytes_per_token"] < fp32_per_token, name
        assert 0 < by_name[name]["kv_bytes"]
    assert by_name["draft:g3"]["draft_kv_bytes_per_token"] > 0 and by_name["ngram:g3"]["draft_kv_bytes_per_token"] == 0
    assert by_name["ngram:g3"]["acceptance_rate"] is not None
    assert all(s["kv_bytes_per_token"] > 0 for s in doc["samples"])
    assert "KV B/tok" in captured.out


def test_kv_usage_errors_come_before_loading(tiny_model_dirs, prompt_file, capsys):
    base = _base_args(tiny_model_dirs, prompt_file)
    assert main(base + ["--kv-sinks", "2"]) == 2
    err = capsys.readouterr().err
    assert "--kv-sinks=2 needs a window" in err and "loading" not in err
    assert main(base + ["--draft-kv-dtype", "int8"]) == 2
    assert "--draft-kv-dtype is only used with a draft model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--kv-budget", "lots"])
    assert "expected a byte count like 1000000, 512M or 2G, got 'lots'" in capsys.readouterr().err


def test_several_weight_formats_run_side_by_side_each_checked_against_its_own_plain_decoding(
        tiny_model_dirs, prompt_file, tmp_path, capsys):
    from kernel_paths import path_problem

    if path_problem("avx2") is not None:
        pytest.skip(f"block formats need one of our kernels: {path_problem('avx2')}")
    out_json, report = tmp_path / "bench.json", tmp_path / "report"
    args = _base_args(tiny_model_dirs, prompt_file) + [
        "--dtype", "bfloat16", "--weights", "bf16,q4_1", "--methods", "none,ngram,hf", "--gammas", "3",
        "--cost-curve", "0", "--json", str(out_json)]
    if matplotlib_available():
        args += ["--report", str(report)]
    assert main(args) == 0
    doc = json.loads(out_json.read_text())
    by_name = {m["name"]: m for m in doc["methods"]}
    assert [n for n in by_name if n != "hf"] == ["none@bf16", "none@q4_1", "ngram:g3@bf16", "ngram:agreement@bf16",
                                                 "ngram:g3@q4_1", "ngram:agreement@q4_1"]
    assert by_name["none@q4_1"]["weights"] == "q4_1, head q8_0" and by_name["none@bf16"]["weights"] == "bf16"
    assert by_name["none@q4_1"]["weight_mb"] < by_name["none@bf16"]["weight_mb"]
    assert by_name["none@q4_1"]["overall"]["speedup_vs_none"] == 1.0  # each format's own reference
    assert doc["identical_outputs"] == doc["identity_comparisons"] == 4 * 4  # 4 drafting methods x 4 prompts
    assert by_name["hf"]["compared_to_none"] == 4  # peers count agreement, against the first format's plain
    if matplotlib_available():
        md = (report / "report.md").read_text()
        assert "## Weights" in md and "| `none@q4_1` | q4_1, head q8_0 |" in md


@pytest.mark.integration
def test_the_structured_suite_on_smollm2_checks_every_answer_against_its_schema(smollm2_path, capsys, tmp_path):
    out = tmp_path / "structured.json"
    rc = main(["bench", "--model", str(smollm2_path), "--threads", "1", "--categories", "structured", "--limit", "3",
               "--methods", "none,ngram", "--gammas", "adaptive", "--max-new-tokens", "96", "--cost-curve", "0",
               "--no-progress", "--json", str(out)])
    table = capsys.readouterr().out
    assert rc == 0
    doc = json.loads(out.read_text())
    assert re.search(r"\bvalid\b", table.splitlines()[0]) and "3/3" in table
    for entry in doc["methods"]:
        f = entry["overall"]
        assert (f["valid_outputs"], f["checked_outputs"]) == (3, 3), entry["name"]
        assert f["mask_ms_per_step"] > 0 and 0 < f["mask_share"] < 1, entry["name"]
    assert doc["identical_outputs"] == doc["identity_comparisons"] == 6  # ngram:adaptive and ngram:agreement
    spec = next(e for e in doc["methods"] if e["name"] == "ngram:adaptive")["overall"]
    assert spec["forced_acceptance"] > 0.5


def test_peers_are_skipped_when_prompts_ask_for_json_schemas(tiny_model_dirs, tmp_path, capsys):
    path = tmp_path / "schemas.jsonl"
    path.write_text(json.dumps({"id": "s1", "category": "structured", "prompt": "the cat",
                                "schema": {"type": "object"}}) + "\n")
    target, _ = tiny_model_dirs
    rc = main(["bench", "--model", str(target), "--dtype", "float32", "--threads", "1", "--prompts", str(path),
               "--methods", "none,hf", "--max-new-tokens", "4", "--cost-curve", "0", "--no-progress", "--json", "-"])
    captured = capsys.readouterr()
    # The tiny models' word-level tokenizer cannot drive a grammar: ours fail, named; the peer is skipped.
    assert rc == 1 and "cannot be used with a grammar" in captured.out
    doc = json.loads(captured.out)
    assert [s["name"] for s in doc["skipped"]] == ["hf"] and "JSON schemas" in doc["skipped"][0]["reason"]


def test_auto_is_handed_each_prompts_prediction_as_a_client_would_send_it(tiny_model_dirs, tmp_path):
    prompts = tmp_path / "edits.jsonl"
    prompts.write_text(json.dumps({"id": "e1", "category": "edit", "prompt": "say one two three",
                                   "prediction": "one two three"}) + "\n")
    out_json = tmp_path / "bench.json"
    args = ["bench", "--model", str(tiny_model_dirs[0]), "--dtype", "float32", "--threads", "1", "--prompts",
            str(prompts), "--max-new-tokens", "8", "--no-progress", "--methods", "none,ngram,auto,prediction",
            "--gammas", "2", "--cost-curve", "0", "--json", str(out_json)]
    assert main(args) == 0
    given = {m["name"]: m["given_predictions"] for m in json.loads(out_json.read_text())["methods"]}
    assert given == {"none": False, "ngram:g2": False, "ngram:agreement": False, "auto:g2": True,
                     "auto:agreement": True, "prediction:g2": True, "prediction:agreement": True}
