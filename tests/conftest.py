"""Fixtures shared by every test package."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2 GGUF, fetched once into the shared cache (``$SPECDECODE_CACHE`` or ~/.cache/specdecode)."""
    from specdecode.models.fetch import fetch

    return fetch("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """SmolLM2 loaded once per test session in the default dtype (bf16 on CPUs that compute it natively)."""
    from specdecode.models.build import load_model

    return load_model(str(smollm2_path))


@pytest.fixture(scope="session")
def smollm2_on(smollm2_path):
    """``smollm2_on(path)``: SmolLM2 in bf16 with its projections on kernel path ``path``, loaded once per
    path per session; skips the calling test, naming the reason, where this CPU cannot run the path."""
    from specdecode.models.build import load_model
    from kernel_paths import require_path

    loaded = {}

    def get(path: str):
        require_path(path)
        if path not in loaded:
            loaded[path] = load_model(str(smollm2_path), dtype="bfloat16", linear=path)
        return loaded[path]
    return get


def pytest_collection_modifyitems(config, items):
    # Slow tests (the Qwen pair, minutes each) run only when asked for with `-m slow`.
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with `make test-slow` (pytest -m slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread; two threads spin against each other on a busy 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_cost_curves(tmp_path_factory, monkeypatch):
    """Each test's warm-up measures its cost curve: curves remembered on this machine (``~/.cache/specdecode/
    costs``) would otherwise stand in for what a test checks was measured."""
    from specdecode.batch import costs

    folder = tmp_path_factory.mktemp("cost-curves")
    monkeypatch.setattr(costs, "cache_dir", lambda: folder)
