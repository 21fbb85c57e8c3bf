"""The docs against the tree: README.md and docs/architecture.md name only files that exist, the README's layout
names every module, the architecture's numbered sections are in order, and its import layers are
pyproject.toml's import-linter contract.

This checks names, not descriptions: a module whose description went stale still passes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "specdecode"
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# Names that look like source files but are projects: "llama.cpp" is llama.cpp, not a file of ours.
NOT_FILES = {"llama.cpp"}
# A file name ending .py, .cpp or .h, with the folders before it: `batch/executor.py`, src/specdecode/cli.py.
FILE_NAME = re.compile(r"(?<![\w./*-])((?:[\w.-]+/)*[\w.-]*\w\.(?:py|cpp|h))(?![\w/])")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
SKIPPED_DIRS = {".git", ".venv", "build", "dist", "node_modules", "__pycache__"}


def _repo_files() -> list[str]:
    """Every file of the checkout as a path relative to its root, with / separators (no VCS, venv or build)."""
    files = []
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if any(p in SKIPPED_DIRS or p.endswith(".egg-info") for p in parts[:-1]) or not path.is_file():
            continue
        files.append("/".join(parts))
    return files


def named_files(text: str) -> set[str]:
    """The .py/.cpp/.h paths a Markdown text names, in prose, backticks, links or code blocks (not URLs, globs)."""
    text = re.sub(r"https?://\S+", " ", text)
    return {m for m in FILE_NAME.findall(text) if m not in NOT_FILES and "*" not in m}


def resolves(name: str, files: list[str]) -> bool:
    """Whether some file's path ends with ``name`` at a folder boundary (``executor.py``, ``batch/executor.py``
    and ``src/specdecode/batch/executor.py`` all name the same file)."""
    name = name.lstrip("./")
    return any(f == name or f.endswith("/" + name) for f in files)


def section(text: str, heading: str) -> str:
    """The text of the Markdown section whose heading line starts with ``heading`` (up to the next heading of
    the same or a higher level)."""
    level = len(heading) - len(heading.lstrip("#"))
    match = re.search(rf"^{re.escape(heading)}.*$", text, re.M)
    assert match, f"no heading starting {heading!r}"
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, match.end())
    return text[match.end():end.start() if end else len(text)]


def layout_entries(readme: str) -> dict[str, str]:
    """The README's layout of src/specdecode/ (the first code block of its "## Layout" section) as entry ->
    text: ``"kv/"`` -> everything on its lines, ``"cli.py"`` -> its lines. An entry starts on a line indented
    two spaces; deeper lines continue it; the tree ends at the first unindented line after the first."""
    block = FENCE.search(section(readme, "## Layout"))
    assert block, "README's Layout section has no code block"
    lines = block.group(1).splitlines()
    assert lines and lines[0].strip() == "src/specdecode/", f"the layout starts {lines[:1]}, not src/specdecode/"
    entries: dict[str, str] = {}
    key = None
    for line in lines[1:]:
        if line and not line.startswith(" "):
            break  # tests/, benchmarks/, ...
        if re.match(r"  \S", line):
            key = line.split()[0]
            entries[key] = line
        elif key is not None:
            entries[key] += "\n" + line
    return entries


def mentions(text: str, name: str) -> bool:
    """Whether ``text`` names ``name`` as a whole file name or path (``rows.py`` is not named by ``arrows.py``)."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text) is not None


def modules() -> list[str]:
    """Every module of the package, relative to src/specdecode/ (``batch/executor.py``), ``__init__.py`` aside."""
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def unnamed_modules(entries: dict[str, str], names: list[str]) -> list[str]:
    """The modules the layout does not name. A top-level module is named by its file name anywhere in the
    tree; ``pkg/x.py`` by ``x.py`` (or ``sub/x.py`` for ``pkg/sub/x.py``) within the entry ``pkg/``."""
    tree = "\n".join(entries.values())
    missing = []
    for module in names:
        parts = module.split("/")
        if len(parts) == 1:
            named = mentions(tree, module)
        else:
            within = entries.get(parts[0] + "/", "")
            named = mentions(within, parts[-1]) or mentions(within, "/".join(parts[1:]))
        if not named:
            missing.append(module)
    return missing


def numbered_headings(text: str) -> list[tuple[int, ...]]:
    """The numbers of ``## N`` and ``### N.M`` headings, in document order (code blocks skipped)."""
    text = FENCE.sub("", text)
    return [tuple(int(n) for n in m.split(".")) for m in re.findall(r"^#{2,3} (\d+(?:\.\d+)*)\.? ", text, re.M)]


def out_of_order(numbers: list[tuple[int, ...]]) -> list[str]:
    """Where a numbered heading does not follow the one before it: each ``## N`` is the last N plus one, and each
    ``### N.M`` belongs to the current N with M one more than the last subsection's."""
    problems, chapter, sub = [], 0, 0
    for number in numbers:
        label = ".".join(map(str, number))
        if len(number) == 1:
            if number[0] != chapter + 1:
                problems.append(f"§{label} after §{chapter}")
            chapter, sub = number[0], 0
        elif len(number) == 2:
            if number != (chapter, sub + 1):
                problems.append(f"§{label} after §{chapter}.{sub}")
            sub = number[1]
        else:
            problems.append(f"§{label}: only ## N and ### N.M are numbered")
    return problems


def parse_layers(lines: list[str]) -> list[frozenset[str]]:
    """Layers as import-linter writes them, top first: ``"serve | bench"`` (independent) or ``"a : b"``, one
    layer per item; in the doc a description may follow a layer after two or more spaces."""
    layers = []
    for line in lines:
        line = re.split(r"\s{2,}|\s#", line.strip(), maxsplit=1)[0]
        if line:
            layers.append(frozenset(part.strip() for part in re.split(r"[|:]", line)))
    return layers


def contract_layers() -> list[frozenset[str]]:
    """The ``layers`` of pyproject.toml's import-linter contract of type "layers" over ``specdecode``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = [c for c in config["tool"]["importlinter"]["contracts"]
                 if c["type"] == "layers" and c["containers"] == ["specdecode"]]
    assert len(contracts) == 1, f"expected one layers contract over specdecode, found {len(contracts)}"
    return parse_layers(contracts[0]["layers"])


def doc_layers(text: str) -> list[frozenset[str]]:
    """The layers listed in the architecture's §7: the section's first code block, one layer per line."""
    block = FENCE.search(section(text, "## 7."))
    assert block, "architecture.md §7 has no code block listing the import layers"
    return parse_layers(block.group(1).splitlines())


# --------------------------------------------------------------------------- the checks


@pytest.mark.parametrize("doc", [README, ARCHITECTURE], ids=lambda p: p.name)
def test_every_source_file_the_docs_name_exists(doc):
    files = _repo_files()
    missing = sorted(name for name in named_files(doc.read_text()) if not resolves(name, files))
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


def test_the_readme_layout_names_every_module():
    missing = unnamed_modules(layout_entries(README.read_text()), modules())
    assert not missing, f"README.md's Layout never names these modules of src/specdecode/: {missing}"


def test_the_architecture_sections_are_numbered_in_order():
    numbers = numbered_headings(ARCHITECTURE.read_text())
    assert numbers, "architecture.md has no numbered sections"
    assert not out_of_order(numbers), out_of_order(numbers)


def test_the_architecture_layers_are_the_import_contract():
    assert doc_layers(ARCHITECTURE.read_text()) == contract_layers(), (
        "docs/architecture.md §7's import layers differ from pyproject.toml's layers contract:\n"
        f"doc:       {[' | '.join(sorted(layer)) for layer in doc_layers(ARCHITECTURE.read_text())]}\n"
        f"contract:  {[' | '.join(sorted(layer)) for layer in contract_layers()]}")


# --------------------------------------------------------------------------- the checks can fail


def test_the_checks_catch_drift():
    files = ["src/specdecode/batch/executor.py", "src/specdecode/models/kernels/attention.h"]
    assert named_files("our `attention_indexed` (widened_bf16.cpp), [x](src/specdecode/batch/executor.py), "
                       "llama.cpp's, `kernels/*.h`, https://e.org/a.py") == {"widened_bf16.cpp",
                                                                              "src/specdecode/batch/executor.py"}
    assert resolves("batch/executor.py", files) and resolves("attention.h", files)
    assert not resolves("widened_bf16.cpp", files) and not resolves("tch/executor.py", files)

    readme = ("## Layout\n\n```\nsrc/specdecode/\n  cli.py   the CLI\n  batch/   executor.py (the step),\n"
              "           rows.py\n  models/  backends/ (base.py)\ntests/   mirrors src/, cli.py\n```\n")
    names = ["batch/executor.py", "batch/rows.py", "batch/arrows.py", "cli.py", "engine.py",
             "models/backends/base.py", "models/backends/compiled.py", "kv/rows.py"]
    assert unnamed_modules(layout_entries(readme), names) == ["batch/arrows.py", "engine.py",
                                                              "models/backends/compiled.py", "kv/rows.py"]

    doc = "## 1. A\n### 1.1 B\n```\n## 9. not a heading\n```\n## 2. C\n### 2.2 D\n### 2.1 E\n### Other\n## 4. F\n"
    assert numbered_headings(doc) == [(1,), (1, 1), (2,), (2, 2), (2, 1), (4,)]
    assert out_of_order(numbered_headings(doc)) == ["§2.2 after §2.0", "§2.1 after §2.2", "§4 after §2"]

    doc = "## 7. Where\n\ntext\n```\ncli\nserve | bench     the commands\nkv | verify\n```\n## 8. Next\n"
    assert doc_layers(doc) == [{"cli"}, {"serve", "bench"}, {"kv", "verify"}]
    assert doc_layers(doc) != parse_layers(["cli", "serve | bench", "kv", "verify"])
