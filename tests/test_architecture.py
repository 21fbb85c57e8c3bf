"""The import architecture: import-linter's contracts in pyproject.toml ([tool.importlinter]) hold for this
checkout's src/: no import cycle between the modules of a package, and no import from a lower layer to a
higher one (imports inside functions included); and the house's sizes: no class over 300 lines, no function over
60, a batch engine that keeps scheduling and the loop, drafter wrappers peeled only inside drafters/."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")  # installed with the dev extra
    # This checkout's sources, not whichever specdecode the environment has installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([str(lint), str(ROOT / "pyproject.toml"), "--no-cache", "--no-logo"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


SRC = ROOT / "src" / "specdecode"
WRAPPERS = {"DrafterWrapper", "DrafterChain", "ForcedDrafter", "PredictionDrafter"}


def _definitions():
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(SRC), node, node.end_lineno - node.lineno + 1


def test_no_class_over_300_lines_and_no_function_over_60():
    too_long = [f"{path}: {node.name} ({lines} lines)" for path, node, lines in _definitions()
                if lines > (300 if isinstance(node, ast.ClassDef) else 60)]
    assert not too_long, too_long


def test_the_batch_engine_keeps_scheduling_and_the_loop_only():
    engine = next(node for path, node, _ in _definitions() if node.name == "BatchEngine")
    methods = [n.name for n in engine.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert engine.end_lineno - engine.lineno + 1 <= 250 and len(methods) <= 15, methods


def test_drafter_wrappers_are_never_peeled_outside_drafters():
    """The engine asks a request's drafter chain (drafters/chain.py); only drafters/ knows how it is wrapped."""
    peeled = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] == "drafters":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                if any(getattr(k, "id", getattr(k, "attr", None)) in WRAPPERS for k in kinds):
                    peeled.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not peeled, peeled
