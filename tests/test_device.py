"""`--device auto|cpu|cuda`: picking the device (runs anywhere), and the plain torch path on a GPU
(marked ``device``; skipped, with the reason, where torch sees no CUDA device).

On CUDA the projections run on F.linear (the torch backend, ``build.pack_model(model, "torch")``; our kernels
and oneDNN are CPU only), the random generator lives on the GPU, and greedy speculation must still reproduce
plain greedy decoding token for token.
"""

from __future__ import annotations

import pytest
import torch

from specdecode.cli import main
from specdecode.drafters import DraftModelDrafter, LayerSkipDrafter, NgramDrafter
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.kv.cache import CacheConfig
from specdecode.models import build
from specdecode.models.build import load_model, pack_model, resolve_device
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams
from test_cli import run
from tiny_models import varied_model, write_tiny_hf_model

NO_CUDA = "torch.cuda.is_available\\(\\) is False"
NEW_TOKENS = 24
pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9], [50, 51, 50, 51, 52, 50, 51, 50, 51, 52, 50, 51],
           [90, 3, 17, 44, 2, 60]]

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: torch.cuda.is_available() is False (CPU-only torch build or no visible GPU)")


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine as one without CUDA, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_gpu(monkeypatch):
    """This machine as one with a single CUDA device (resolve_device only asks; nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


# --------------------------------------------------------------------------- resolve_device (any machine)


def test_auto_is_cuda_where_torch_sees_a_gpu_else_cpu(monkeypatch):
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")  # this machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"


def test_cpu_is_always_there(no_cuda):
    assert resolve_device("cpu") == "cpu"
    assert resolve_device(torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_without_cuda_names_the_device_and_why(no_cuda, name):
    why = "\\(this torch build is CPU-only or no GPU is visible\\)"
    with pytest.raises(ValueError, match=f"^--device {name}: {NO_CUDA} {why}$"):
        resolve_device(name)


def test_cuda_devices_that_exist_are_accepted_others_refused(one_gpu):
    assert resolve_device("cuda") == "cuda"
    assert resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(ValueError, match="--device cuda:1: this machine has 1 CUDA device\\(s\\), cuda:0..cuda:0"):
        resolve_device("cuda:1")


@pytest.mark.parametrize("name", ["gpu", "tpu", "mps", "cuda:", "cuda:x", "cpu:0", "CUDA", ""])
def test_unknown_device_names_are_refused(one_gpu, name):
    with pytest.raises(ValueError, match=f"device {name!r} is not one of auto, cpu, cuda, cuda:N"):
        resolve_device(name)


def test_load_model_refuses_a_missing_gpu_before_reading_weights(no_cuda, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("load_checkpoint was called")

    monkeypatch.setattr(build, "load_checkpoint", never)
    with pytest.raises(ValueError, match=f"--device cuda: {NO_CUDA}"):
        load_model("/no/such/model", device="cuda")


def test_sampling_generator_on_the_cpu_is_the_one_it_always_was():
    # The engine now asks for a generator on the model's device; on the CPU its stream must not change.
    for seed in (0, 1234):
        before = torch.Generator().manual_seed(seed)
        assert torch.equal(torch.rand(16, generator=SamplingParams(seed=seed).generator("cpu")),
                           torch.rand(16, generator=before))
        assert SamplingParams(seed=seed).generator(torch.device("cpu")).device.type == "cpu"


# --------------------------------------------------------------------------- the CLI (any machine)




def _one_error_line(rc: int, out: str, err: str) -> str:
    assert rc == 2, (rc, err)
    assert out == "" and "Traceback" not in err
    prefixes = ("specdecode: error: ", "specdecode generate: error: ", "specdecode calibrate-layerskip: error: ")
    errors = [line for line in err.splitlines() if line.startswith(prefixes)]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize("command", [["generate", "hello"], ["calibrate-layerskip"]])
def test_cli_device_cuda_without_cuda_is_one_error_line_before_loading(no_cuda, monkeypatch, capsys, command):
    def never(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("specdecode.target.load_model", never)
    rc, out, err = run(capsys, command[0], "--model", "/no/such/model", "--device", "cuda", *command[1:])
    line = _one_error_line(rc, out, err)
    assert line == ("specdecode: error: --device cuda: torch.cuda.is_available() is False (this torch build is "
                    "CPU-only or no GPU is visible)")


def test_cli_refuses_an_unknown_device(capsys):
    rc, out, err = run(capsys, "generate", "--device", "tpu", "hello")
    assert "--device: invalid choice: 'tpu'" in _one_error_line(rc, out, err)


def test_cli_device_reaches_load_model(no_cuda, monkeypatch, capsys, tmp_path):
    # auto resolves (to cpu here) before the model is loaded, and every load gets the same device.
    folder = write_tiny_hf_model(tmp_path / "tiny")
    devices = []

    def spy(source, dtype="auto", device="cpu", **kwargs):
        devices.append(device)
        return load_model(source, dtype, device, **kwargs)

    monkeypatch.setattr("specdecode.target.load_model", spy)  # the target
    monkeypatch.setattr("specdecode.drafter_setup.load_model", spy)  # the draft model
    for flag in ([], ["--device", "auto"], ["--device", "cpu"]):
        rc, out, err = run(capsys, "generate", "--model", folder, "--threads", "1", "--dtype", "float32", "--json",
                            "--drafter", "draft", "--draft-model", folder, "--max-new-tokens", "4", *flag,
                            "the cat sat")
        assert rc == 0, err
    assert devices == ["cpu"] * 6  # target and draft, three times


# --------------------------------------------------------------------------- on a CUDA GPU (marked `device`)


def _on(device: str, model: Transformer) -> Transformer:
    model = model.to(device)
    assert pack_model(model, "torch").name == "torch"  # the plain torch path: F.linear
    assert model.device.type == torch.device(device).type
    return model


def _drafter(kind: str, target: Transformer, draft: Transformer):
    return {"ngram": NgramDrafter(max_ngram=3, min_ngram=1), "layerskip": LayerSkipDrafter(target, [1]),
            "draft": DraftModelDrafter(draft, target)}[kind]


def check_greedy_speculation_is_exact(device: str, kind: str, dtype: torch.dtype,
                                      cache: CacheConfig = CacheConfig()) -> None:
    """What tests/models/test_linear.py checks on the tiled kernel, on ``device`` with F.linear."""
    target = _on(device, varied_model(0, dtype=dtype))
    draft = _on(device, varied_model(0, keep_layers=[0, 1], dtype=dtype))
    plain = [Engine(target, cache=cache).generate(p, max_new_tokens=NEW_TOKENS).token_ids for p in PROMPTS]
    assert all(len(set(ids)) >= 4 for ids in plain)  # the reference is not degenerate
    drafted = accepted = 0
    for gamma in (2, 7, "adaptive"):
        engine = Engine(target, drafter=_drafter(kind, target, draft), spec=SpeculativeConfig(gamma=gamma),
                        cache=cache)
        for prompt, want in zip(PROMPTS, plain):
            result = engine.generate(prompt, max_new_tokens=NEW_TOKENS)
            assert result.token_ids == want, (device, kind, dtype, gamma, prompt)
            drafted += result.stats.drafted_tokens
            accepted += result.stats.accepted_tokens
    assert drafted > accepted  # rejections were rolled back ...
    assert accepted > 0  # ... and acceptances kept


def check_warmup_and_padding_change_no_output(device: str, dtype: torch.dtype) -> None:
    """Row padding (tuned by warmup, then the most there is) keeps greedy speculation exact on ``device``."""
    target = _on(device, varied_model(0, dtype=dtype))
    draft = _on(device, varied_model(0, keep_layers=[0, 1], dtype=dtype))
    plain = [Engine(target).generate(p, max_new_tokens=NEW_TOKENS).token_ids for p in PROMPTS]
    engine = Engine(target, drafter=DraftModelDrafter(draft, target), spec=SpeculativeConfig(gamma=3))
    engine.warmup()
    padding = engine.batch.timer.padding
    assert set(padding.table) == set(range(1, 9))
    for padded in (dict(padding.table), {n: 8 for n in range(1, 9)}):
        padding.table = padded
        assert [engine.generate(p, max_new_tokens=NEW_TOKENS).token_ids for p in PROMPTS] == plain, padded


def check_sampling_is_deterministic_for_a_seed(device: str, kind: str) -> None:
    target = _on(device, varied_model(0, dtype=torch.bfloat16))
    draft = _on(device, varied_model(0, keep_layers=[0, 1], dtype=torch.bfloat16))
    assert SamplingParams(seed=1).generator(target.device).device.type == torch.device(device).type

    def run(seed: int) -> list[int]:
        # A fresh engine each time: nothing but the seed carries over.
        drafter = _drafter(kind, target, draft) if kind != "none" else None
        engine = Engine(target, drafter=drafter, spec=SpeculativeConfig(gamma=3))
        sampling = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=seed)
        result = engine.generate(PROMPTS[2], sampling, max_new_tokens=NEW_TOKENS)
        assert len(result.token_ids) == NEW_TOKENS and all(0 <= t < target.config.vocab_size for t in result.token_ids)
        return result.token_ids

    first = run(1234)
    assert run(1234) == first
    assert len({tuple(run(seed)) for seed in (1, 2, 3)} | {tuple(first)}) > 1


@pytest.mark.device
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["ngram", "layerskip", "draft"])
def test_greedy_speculation_is_exact_on_cuda(kind, dtype):
    check_greedy_speculation_is_exact("cuda", kind, dtype)


@pytest.mark.device
@needs_cuda
@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_greedy_speculation_is_exact_on_cuda_with_an_int8_window_cache_and_prefix_cache(kind):
    # Small groups and window, so that these short requests quantize, evict and reuse prefixes.
    cache = CacheConfig(kv_dtype="int8", window=16, sinks=4, prefix_cache=True, group_size=8, residual=8,
                        prefill_chunk=8)
    check_greedy_speculation_is_exact("cuda", kind, torch.bfloat16, cache)


@pytest.mark.device
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_warmup_and_row_padding_on_cuda_change_no_output(dtype):
    check_warmup_and_padding_change_no_output("cuda", dtype)


@pytest.mark.device
@needs_cuda
@pytest.mark.parametrize("kind", ["none", "ngram", "layerskip", "draft"])
def test_sampling_on_cuda_is_deterministic_for_a_seed(kind):
    check_sampling_is_deterministic_for_a_seed("cuda", kind)


@pytest.mark.device
@needs_cuda
def test_cli_generate_runs_on_cuda(capsys, tmp_path, monkeypatch):
    import json

    monkeypatch.delenv("SPECDECODE_LINEAR", raising=False)  # --linear auto: F.linear on a GPU
    folder = write_tiny_hf_model(tmp_path / "tiny")
    outputs = []
    for drafter in ("none", "ngram", "layerskip"):
        skip = ["--skip-layers", "1"] if drafter == "layerskip" else []
        rc, out, err = run(capsys, "generate", "--model", folder, "--device", "cuda", "--dtype", "float32", "--json",
                            "--drafter", drafter, *skip, "--max-new-tokens", "16", "the cat sat on the mat and the cat")
        assert rc == 0, err
        outputs.append(json.loads(out)["token_ids"])
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
