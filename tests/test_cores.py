"""The cores a process may use and a server's default kernel threads (``cores.py``)."""

from __future__ import annotations

import os

import pytest

from specdecode.cores import server_threads, usable_cores


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 2), (4, 4), (7, 7), (8, 7), (64, 63)])
def test_a_server_leaves_one_core_to_the_http_side_from_eight_cores(cores, threads):
    assert server_threads(cores) == threads


def test_the_usable_cores_are_the_affinity_masks(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5})
    assert usable_cores() == 3 and server_threads() == 3
