"""llamacpp_tools: the peers' build runs cmake + ninja on the source distribution's vendor/llama.cpp and
installs every tool, or fails naming the step; a missing tool is refused with the build command. A tiny
CMake project stands in for llama.cpp (the real build takes 15 minutes)."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from specdecode.bench import llamacpp_tools
from specdecode.cli import main

FAKE_CMAKE = """cmake_minimum_required(VERSION 3.14)
project(fake_llama C)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
foreach(tool llama-server llama-bench llama-speculative-simple llama-lookup)
  add_executable(${tool} main.c)
endforeach()
"""


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))


def fake_sdist(cmake: str):
    def download(requirement: str, dest: Path) -> Path:
        assert requirement == llamacpp_tools.SDIST
        root = dest / "pkg-src" / "llama_cpp_python-0.0" / "vendor" / "llama.cpp"
        root.mkdir(parents=True)
        (root / "CMakeLists.txt").write_text(cmake)
        (root / "main.c").write_text('#include <stdio.h>\nint main(void) { puts("fake llama"); return 0; }\n')
        archive = dest / "llama_cpp_python-0.0.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(dest / "pkg-src" / "llama_cpp_python-0.0", arcname="llama_cpp_python-0.0")
        shutil.rmtree(dest / "pkg-src")
        return archive
    return download


needs_toolchain = pytest.mark.skipif(not all(shutil.which(p) for p in ("cmake", "ninja", "cc")),
                                     reason="needs cmake, ninja and a C compiler")


def test_a_missing_tool_is_refused_with_the_build_command(capsys):
    with pytest.raises(llamacpp_tools.PeerMissing, match="specdecode peers build"):
        llamacpp_tools.require("llama-server")
    assert main(["peers", "list"]) == 0
    assert capsys.readouterr().out.count("not built (`specdecode peers build`)") == len(llamacpp_tools.TOOLS)


@needs_toolchain
def test_build_installs_every_tool(tmp_path):
    said: list[str] = []
    folder = llamacpp_tools.build(said.append, jobs=2, downloader=fake_sdist(FAKE_CMAKE))
    assert folder == llamacpp_tools.build_dir() / "bin"
    for tool in llamacpp_tools.TOOLS:
        path = llamacpp_tools.require(tool)
        assert subprocess.run([str(path)], capture_output=True, text=True).stdout == "fake llama\n"
    assert any(line.startswith("[4/4] building") for line in said) and any("compiled" in line for line in said)
    assert [p.name for p in folder.parent.parent.iterdir()] == [folder.parent.name]  # no temporary folder left


@needs_toolchain
def test_a_failed_build_names_the_step_and_leaves_nothing(tmp_path):
    broken = FAKE_CMAKE.replace("main.c", "missing.c")
    with pytest.raises(RuntimeError, match="cmake failed|the build failed"):
        llamacpp_tools.build(lambda line: None, jobs=2, downloader=fake_sdist(broken))
    assert llamacpp_tools.find("llama-server") is None
    assert list(llamacpp_tools.build_dir().parent.iterdir()) == []
