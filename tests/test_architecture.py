"""The import architecture: import-linter's contracts in pyproject.toml ([tool.importlinter]) hold for this
checkout's src/: no import cycle between the modules of a package, and no import from a lower layer to a
higher one (imports inside functions included)."""

from __future__ import annotations

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
