"""The cores a process may use, a server's default kernel threads and bounded OpenMP spinning (``cores.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specdecode.cores import SPIN_COUNT, bound_openmp_spin, server_threads, usable_cores


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 2), (4, 4), (7, 7), (8, 7), (64, 63)])
def test_a_server_leaves_one_core_to_the_http_side_from_eight_cores(cores, threads):
    assert server_threads(cores) == threads


def test_the_usable_cores_are_the_affinity_masks(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5})
    assert usable_cores() == 3 and server_threads() == 3


@pytest.mark.parametrize("environ, spin", [({}, SPIN_COUNT), ({"GOMP_SPINCOUNT": "7"}, "7"),
                                           ({"OMP_WAIT_POLICY": "ACTIVE"}, None)])
def test_openmp_spinning_is_bounded_unless_the_user_chose(environ, spin):
    bound_openmp_spin(environ)
    assert environ.get("GOMP_SPINCOUNT") == spin


def test_the_command_line_bounds_spinning_before_torch_loads_libgomp():
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    # libgomp reads GOMP_SPINCOUNT once, when torch loads it: torch must not be loaded before cli.py sets it.
    code = ("import sys, specdecode.cores; assert 'torch' not in sys.modules, 'torch loaded before the bound'; "
            "import os, specdecode.cli; print(os.environ['GOMP_SPINCOUNT'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == SPIN_COUNT
