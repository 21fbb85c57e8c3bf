"""The cores a process may use, a server's default kernel threads and bounded OpenMP spinning (``cores.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specdecode import cores
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
    # libgomp reads GOMP_SPINCOUNT once, when torch loads it: cli.py must set it before anything imports torch.
    code = ("import os, sys, specdecode.cores as cores\n"
            "seen, bound = [], cores.bound_openmp_spin\n"
            "cores.bound_openmp_spin = lambda environ=None: (seen.append('torch' in sys.modules), bound(environ))\n"
            "import specdecode.cli\n"
            "print(seen, os.environ['GOMP_SPINCOUNT'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[False] {SPIN_COUNT}"  # called once, torch not yet loaded


def test_peers_get_libgomps_own_spinning_unless_the_user_chose(monkeypatch):
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cores, "_bound_here", False)
    cores.bound_openmp_spin()
    assert os.environ["GOMP_SPINCOUNT"] == SPIN_COUNT and "GOMP_SPINCOUNT" not in cores.peer_environ()
    monkeypatch.setattr(cores, "_bound_here", False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    cores.bound_openmp_spin()
    assert cores.peer_environ()["GOMP_SPINCOUNT"] == "7"


def test_more_threads_than_cores_is_warned_about_naming_both():
    assert cores.oversubscription_warning(2, cores=2) is None
    warning = cores.oversubscription_warning(3, cores=2)
    assert "--threads 3" in warning and "2 core(s)" in warning and "at most --threads 2" in warning


def test_the_command_line_warns_before_it_loads_anything(capsys, monkeypatch):
    from specdecode.cli import main

    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this test process keeps its threads
    assert main(["generate", "--model", "/no/such/model.gguf", "--threads", "3", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--threads 3 is more than the 2 core(s)" in err and "error" in err
    assert main(["generate", "--model", "/no/such/model.gguf", "--threads", "2", "hi"]) == 2
    assert "more than" not in capsys.readouterr().err
