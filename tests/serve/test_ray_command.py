"""`serve --ray` flags and errors that need no cluster."""

from __future__ import annotations

import os
import sys

import pytest

from specdecode.cli import build_parser, main
from specdecode.cores import SPIN_COUNT
from specdecode.serve.flags import serve_config
from specdecode.serve.ray_command import run_ray


def test_the_ray_flags_parse_and_refuse_bad_values(capsys):
    args = build_parser().parse_args(["serve", "--ray", "--replicas", "3", "--cpus-per-replica", "0.5",
                                      "--ingress-replicas", "2", "--routing", "pow2", "--ray-address", "auto"])
    assert (args.ray, args.replicas, args.cpus_per_replica, args.routing, args.ray_address, args.ingress_replicas) == \
        (True, 3, 0.5, "pow2", "auto", 2)
    for bad in (["--cpus-per-replica", "0"], ["--replicas", "0"], ["--routing", "random"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--ray", *bad])
        assert bad[0] in capsys.readouterr().err


def test_without_ray_installed_the_error_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    config = serve_config(build_parser().parse_args(["serve", "--ray"]))
    with pytest.raises(ValueError, match=r"needs Ray Serve \(ray is missing\): pip install 'specdecode\[ray\]'"):
        run_ray(config, print)


def test_the_cli_prints_it_as_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(["serve", "--ray"]) == 2
    assert capsys.readouterr().err.strip().startswith("specdecode: error: specdecode serve --ray needs Ray Serve")


def test_the_config_file_builder_checks_its_args():
    pytest.importorskip("ray.serve")
    from ray.serve import Application

    from specdecode.serve.ray_app import app_builder

    assert isinstance(app_builder({"flags": ["--drafter", "none"], "replicas": 2, "ingress_replicas": 2}), Application)
    with pytest.raises(ValueError, match="unknown app_builder args: replica"):
        app_builder({"replica": 2})
    with pytest.raises(ValueError, match="routing must be 'prefix' or 'pow2'"):
        app_builder({"routing": "random"})
    with pytest.raises(ValueError, match="replicas and ingress_replicas must be >= 1"):
        app_builder({"replicas": 0})


@pytest.mark.xdist_group("ray")  # with the other tests that start a Ray cluster, on one worker
def test_more_replicas_than_free_cpus_are_refused_and_the_cluster_is_shut_down():
    ray = pytest.importorskip("ray")
    config = serve_config(build_parser().parse_args(["serve", "--ray", "--replicas", str(64 * (os.cpu_count() or 1))]))
    with pytest.raises(ValueError, match=r"replica\(s\) of 1 CPU need \d+ CPUs; the Ray cluster has \d+ free"):
        run_ray(config, print)
    assert not ray.is_initialized()


@pytest.mark.parametrize("driver, replica", [({}, {"GOMP_SPINCOUNT": SPIN_COUNT}),
                                             ({"GOMP_SPINCOUNT": "1234"}, {"GOMP_SPINCOUNT": "1234"}),
                                             ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"})])
def test_the_replicas_spin_bounded_unless_the_user_chose(monkeypatch, driver, replica):
    pytest.importorskip("ray.serve")
    from specdecode.serve.ray_app import build_application

    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in driver.items():
        monkeypatch.setenv(name, value)
    app = build_application(serve_config(build_parser().parse_args(["serve", "--ray", "--api-key", "k"])),
                            replicas=1, cpus_per_replica=0.5)
    deployments = {d.name: d for d in (getattr(a, "_bound_deployment", None) for a in app._bound_deployment.init_args)
                   if d is not None}
    env = deployments["EngineServer"].ray_actor_options["runtime_env"]["env_vars"]
    assert env == {"OMP_NUM_THREADS": "1", **replica}
