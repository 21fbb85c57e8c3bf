"""llama.cpp's own tools as peers: ``llama-server``, ``llama-bench``, ``llama-speculative-simple`` and
``llama-lookup``, built from the llama.cpp that the llama-cpp-python source distribution carries whole
(``vendor/llama.cpp``) with cmake and ninja (``specdecode peers build`` or ``make peers``: about 15 min on 2
cores; never part of the tests or of set-up), into ``cache_dir()/peers/<sdist>-<cpu>/bin``.

A build is kept per CPU feature set: llama.cpp compiles for the CPU it is built on (``GGML_NATIVE``), and a
binary built on one machine may not run on the next. A tool that is missing is refused with the build
command (``require``).

This module builds and finds the tools; ``llamacpp_server.py`` runs llama-server for ``bench`` and
``bench-serve``, and llama-bench is run by hand (docs/bench.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable

from specdecode.models.fetch import cache_dir
from specdecode.models.native import cpu_flags, cpu_model

SDIST = "llama-cpp-python==0.3.36"
TOOLS = ("llama-server", "llama-bench", "llama-speculative-simple", "llama-lookup")
BUILD_COMMAND = "specdecode peers build"
# Static, CPU-only, no network code: the tools only read a local GGUF.
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF")

Say = Callable[[str], None]
Downloader = Callable[[str, Path], Path]


class PeerMissing(ValueError):
    """A llama.cpp tool that has not been built on this machine; the message gives the build command."""


def build_dir() -> Path:
    """Where this machine's build lives: one per source distribution and CPU feature set."""
    digest = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:10]
    return cache_dir() / "peers" / f"{SDIST.replace('==', '-')}-{digest}"


def find(tool: str) -> Path | None:
    """The built ``tool``'s path, or None."""
    path = build_dir() / "bin" / tool
    return path if path.is_file() and os.access(path, os.X_OK) else None


def require(tool: str) -> Path:
    """The built ``tool``'s path.

    Raises:
        PeerMissing: it has not been built here (the message names the command that builds it).
    """
    path = find(tool)
    if path is None:
        raise PeerMissing(f"llama.cpp's {tool} is not built on this machine; build the peers once with "
                          f"`{BUILD_COMMAND}` (or `make peers`; about 15 min on 2 cores)")
    return path


def download_sdist(requirement: str, dest: Path) -> Path:
    """The source distribution of ``requirement`` downloaded into ``dest`` (pip prepares its metadata in an isolated
    environment; nothing is built or installed)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "--quiet", "--dest", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob("*.tar.gz"))
    if proc.returncode != 0 or not found:
        tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
        raise RuntimeError(f"`pip download {requirement}` (source) failed with exit code {proc.returncode}: {tail}")
    return found[0]


def build(say: Say, jobs: int | None = None, downloader: Downloader = download_sdist) -> Path:
    """Downloads the source distribution, builds TOOLS and installs them in ``build_dir()/bin``.

    The build happens in a temporary folder beside it and is renamed into place only when every tool was
    built, so an interrupted build leaves nothing half-made.

    Args:
        say: told each step, and the compiler's progress every tenth of the way.
        jobs: parallel compile jobs (default: the CPU count).
        downloader: fetches the source distribution into a folder and returns its path (tests substitute one).

    Returns:
        The folder holding the tools.

    Raises:
        RuntimeError: a tool (cmake, ninja, a C++ compiler, pip) is missing or a step failed; the message
            names the step and ends with its output's last lines.
    """
    for program in ("cmake", "ninja"):
        if shutil.which(program) is None:
            raise RuntimeError(f"building llama.cpp's tools needs {program} on PATH "
                               "(Debian: apt install cmake ninja-build)")
    final = build_dir()
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        say(f"[1/4] downloading {SDIST} (source distribution)")
        archive = downloader(SDIST, work)
        say(f"[2/4] unpacking {archive.name}")
        with tarfile.open(archive) as tar:
            tar.extractall(work / "src", filter="data")
        sources = [p for p in (work / "src").glob("*/vendor/llama.cpp") if (p / "CMakeLists.txt").is_file()]
        if not sources:
            raise RuntimeError(f"{archive.name} has no vendor/llama.cpp/CMakeLists.txt")
        say("[3/4] configuring with cmake")
        _run(["cmake", "-S", str(sources[0]), "-B", str(work / "build"), "-G", "Ninja", *CMAKE_OPTIONS], "cmake", say)
        say(f"[4/4] building {', '.join(TOOLS)} (about 15 min on 2 cores)")
        _run(["cmake", "--build", str(work / "build"), "--target", *TOOLS, "-j", str(jobs or os.cpu_count() or 2)],
             "the build", say, progress=True)
        bin_dir = work / "bin"
        bin_dir.mkdir()
        for tool in TOOLS:
            built = next((work / "build").glob(f"**/bin/{tool}"), None)
            if built is None:
                raise RuntimeError(f"the build produced no {tool}")
            shutil.copy2(built, bin_dir / tool)
        manifest = {"sdist": SDIST, "cpu": cpu_model(), "tools": list(TOOLS), "cmake": list(CMAKE_OPTIONS)}
        (bin_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(final, ignore_errors=True)  # an older build of the same key
        final.mkdir()
        os.replace(bin_dir, final / "bin")
        say(f"built {len(TOOLS)} tools in {final / 'bin'}")
        return final / "bin"
    finally:
        shutil.rmtree(work, ignore_errors=True)


_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")


def _run(cmd: list[str], what: str, say: Say, progress: bool = False) -> None:
    """Runs ``cmd``; with ``progress``, tells ``say`` ninja's step every tenth of the way. Raises RuntimeError
    naming ``what`` with the output's last lines when it fails."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        raise RuntimeError(f"could not run {cmd[0]} for {what}: {exc}") from exc
    tail: list[str] = []
    shown = 0
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-12:]
        step = _NINJA_STEP.match(line)
        if progress and step:
            done, total = int(step.group(1)), int(step.group(2))
            if done * 10 // total > shown or done == total:
                shown = done * 10 // total
                say(f"  compiled {done}/{total}")
    if proc.wait() != 0:
        raise RuntimeError(f"{what} failed with exit code {proc.returncode}:\n" + "\n".join(tail))
