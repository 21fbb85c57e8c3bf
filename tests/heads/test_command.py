"""`specdecode train-head` end to end on a tiny HF folder, then `generate --drafter eagle|medusa` with the file
it wrote; and one clear error line for each bad head input."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode.cli import main
from specdecode.heads.file import load_head
from test_cli import FAST, _restore_threads, assert_usage_error, generate_json, run  # noqa: F401 - autouse fixture
from tiny_models import WORDS, write_tiny_hf_model

PROMPTS = [{"id": f"p{i}", "category": "qa", "prompt": " ".join(WORDS[i * 7:i * 7 + 9])} for i in range(8)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target and an eagle, an EAGLE-3 (fused layers, soft labels) and a medusa head trained for it by the
    command."""
    root = tmp_path_factory.mktemp("heads")
    target = write_tiny_hf_model(root / "target")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    heads = {}
    recipes = {"eagle": [], "medusa": ["--kind", "medusa"],
               "eagle3": ["--fuse-layers", "eagle3", "--soft-labels", "--regress", "0", "--ce-weight", "1"]}
    for kind, flags in recipes.items():
        out = root / f"{kind}.safetensors"
        rc = main(["train-head", "--model", str(target), *FAST, *flags, "--out", str(out), "--prompts",
                   str(prompts), "--text-chunks", "2", "--epochs", "2", "--max-new-tokens", "16", "--data-dir",
                   str(root / "data"), "--no-progress", "--draft-vocab", "40"])
        assert rc == 0
        heads[kind] = out
    return {"target": target, "root": root, **heads}


def test_train_head_writes_a_checked_file_with_its_recipe(trained):
    head = load_head(trained["eagle"])
    assert head.kind == "eagle" and head.draft_vocab == 40 and head.vocab.numel() == 97
    assert head.recipe["train"]["epochs"] == 2 and len(head.recipe["history"]) == 2
    assert head.recipe["sequences"] == 3 * len(PROMPTS) + 2  # greedy and 2 sampled answers each + text chunks
    assert not (trained["root"] / "eagle.safetensors.ckpt").exists()  # the checkpoint goes once the file is written
    assert (trained["root"] / "data" / "answers.jsonl").read_text().count("\n") == 3 * len(PROMPTS)
    fused = load_head(trained["eagle3"])  # the same answers, its own features file
    assert fused.config["fuse_layers"] == [1, 2, 4] and fused.recipe["train"]["soft_labels"]
    assert sorted(p.name for p in (trained["root"] / "data").glob("features*")) == [
        "features-l1-2-4.safetensors", "features.safetensors"]


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_generate_with_a_trained_head_matches_plain_decoding(trained, capsys, kind):
    plain = generate_json(capsys, trained["target"], "--max-new-tokens", "24", "--drafter", "none")
    doc = generate_json(capsys, trained["target"], "--max-new-tokens", "24", "--drafter", kind.removesuffix("3"),
                        "--head", trained[kind], "--gamma", "3")
    assert doc["token_ids"] == plain["token_ids"]
    assert doc["stats"]["drafted_tokens"] > 0


def test_head_errors_are_one_line(trained, capsys, tmp_path):
    rc, out, err = run(capsys, "generate", "--model", trained["target"], *FAST, "--drafter", "eagle",
                       "--head", trained["medusa"], "x")
    assert_usage_error(rc, out, err, "is a medusa head, not a eagle head")
    rc, out, err = run(capsys, "generate", "--model", trained["target"], *FAST, "--drafter", "ngram",
                       "--head", trained["eagle"], "x")
    assert_usage_error(rc, out, err, "--head is only used by --drafter eagle|eagle-tree|medusa")
    rc, out, err = run(capsys, "generate", "--model", trained["target"], *FAST, "--drafter", "eagle", "x")
    assert_usage_error(rc, out, err, "no eagle head ships for", "--head FILE")
    other = write_tiny_hf_model(tmp_path / "other", seed=5)
    rc, out, err = run(capsys, "generate", "--model", other, *FAST, "--drafter", "eagle", "--head", trained["eagle"], "x")
    assert_usage_error(rc, out, err, "eagle.safetensors: head was trained for a model with weights fingerprint")
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(trained["eagle"].read_bytes()[:-3] + b"xyz")
    rc, out, err = run(capsys, "generate", "--model", trained["target"], *FAST, "--drafter", "eagle", "--head",
                       damaged, "x")
    assert_usage_error(rc, out, err, "damaged.safetensors: checksum mismatch")
    rc, out, err = run(capsys, "train-head", "--model", trained["target"], *FAST, "--out", tmp_path / "h.bin")
    assert_usage_error(rc, out, err, "a head file is named *.safetensors")
    rc, out, err = run(capsys, "train-head", "--model", trained["target"], *FAST, "--out", tmp_path / "h.safetensors",
                       "--resume")
    assert_usage_error(rc, out, err, "no checkpoint")
    rc, out, err = run(capsys, "train-head", "--model", trained["target"], *FAST, "--out", tmp_path / "h.safetensors",
                       "--draft-vocab", "-1")
    assert_usage_error(rc, out, err, "--draft-vocab must be >= 0")
    for bad, says in (("7", "each must be one of 0..4"), ("1,1", "none twice"), ("low", "expected none, eagle3 or")):
        rc, out, err = run(capsys, "train-head", "--model", trained["target"], *FAST, "--out",
                           tmp_path / "h.safetensors", "--fuse-layers", bad, "--data-dir", trained["root"] / "data",
                           "--prompts", trained["root"] / "prompts.jsonl", "--text-chunks", "2", "--max-new-tokens", "16")
        assert_usage_error(rc, out, err, f"--fuse-layers '{bad}'", says)
    for flags, says in ((["--kind", "medusa", "--soft-labels", "--unroll", "3"], "--soft-labels, --unroll: only for "
                                                                                  "--kind eagle, not medusa"),
                        (["--regress", "0", "--ce-weight", "0"], "leave nothing to train"),
                        (["--regress", "-1"], "--regress must be >= 0")):
        rc, out, err = run(capsys, "train-head", "--model", trained["target"], *FAST, "--out",
                           tmp_path / "h.safetensors", *flags)
        assert_usage_error(rc, out, err, says)
        assert "loading" not in err  # refused before the model is read
    rc, out, err = run(capsys, "train-head", "--model", trained["target"], *FAST, "--out", tmp_path / "h.safetensors",
                       "--prompts", tmp_path / "missing.jsonl")
    assert_usage_error(rc, out, err, "missing.jsonl")
    assert "loading" not in err  # both refused before the model is read


def test_resume_continues_from_the_checkpoint(trained, capsys, tmp_path, monkeypatch):
    """Interrupted after epoch 1 (the checkpoint is what it left), resumed to 2: the uninterrupted run's file."""
    import specdecode.heads.train as train_module

    args = ["train-head", "--model", trained["target"], *FAST, "--kind", "medusa", "--prompts",
            trained["root"] / "prompts.jsonl", "--text-chunks", "2", "--max-new-tokens", "16", "--data-dir",
            trained["root"] / "data", "--no-progress", "--draft-vocab", "40", "--epochs", "2"]
    out = tmp_path / "m.safetensors"
    real_train_epoch = train_module.Trainer.train_epoch

    def interrupted(self, progress=None):
        if self.epoch == 1:
            raise KeyboardInterrupt
        return real_train_epoch(self, progress)

    monkeypatch.setattr(train_module.Trainer, "train_epoch", interrupted)
    rc, _, err = run(capsys, *args, "--out", out)
    monkeypatch.undo()
    assert rc == 130 and not out.exists() and (tmp_path / "m.safetensors.ckpt").exists(), err
    rc, _, err = run(capsys, *args, "--out", out, "--resume")
    assert rc == 0, err
    resumed, straight = load_head(out), load_head(trained["medusa"])
    for name, tensor in straight.weights.items():
        assert torch.equal(tensor, resumed.weights[name]), name
