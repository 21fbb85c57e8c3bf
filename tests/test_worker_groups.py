"""`make test`'s pytest-xdist grouping works with the installed pytest: the tests marked ``xdist_group("ray")``
start Ray clusters and must share one worker (two clusters on 2 CPUs, each set up twice, cost the suite a minute).
pytest 9.2 with pytest-xdist 3.8 dropped the groups without a word; pyproject.toml's dev extra keeps pytest below it.
"""

from __future__ import annotations

import os
import subprocess
import sys

TESTS = '''
import os

import pytest


@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    with open(os.path.join(os.environ["OUT"], f"grouped-{i}"), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])


@pytest.mark.parametrize("i", range(6))
def test_free(i):
    pass
'''


def test_tests_of_one_group_run_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(TESTS)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")} | {"OUT": str(out)}  # not this worker's
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadgroup", "--rootdir", str(tmp_path), str(tmp_path / "test_grouped.py")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = {p.read_text() for p in out.iterdir()}
    assert len(list(out.iterdir())) == 6 and len(workers) == 1, f"the group ran on workers {sorted(workers)}"

