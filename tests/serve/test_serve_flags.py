"""`serve`'s flags as a ServeConfig: each part where it belongs, contradictions refused before anything
loads, and a config that survives pickling (Ray hands it to every replica)."""

from __future__ import annotations

import os
import pickle

import pytest

from specdecode.serve.config import RayConfig
from specdecode.serve.flags import serve_flags


def test_the_flags_land_in_their_parts():
    config = serve_flags(["--model", "some.gguf", "--device", "cpu", "--drafter", "eagle", "--draft-vocab", "512",
                          "--gamma", "3", "--max-running", "2", "--max-waiting", "5", "--max-len", "1024",
                          "--kv-dtype", "int8", "--draft-kv-dtype", "bfloat16", "--served-model-name", "m",
                          "--port", "9000", "--threads", "2"])
    assert (config.target.model, config.target.device) == ("some.gguf", "cpu")
    assert (config.drafter.kind, config.drafter.draft_vocab) == ("eagle", 512) and config.drafter.has_draft_cache
    assert config.speculation.gamma == 3
    assert (config.scheduler.max_running, config.scheduler.max_waiting, config.scheduler.max_rows) == (2, 5, 4)
    assert (config.cache.kv_dtype, config.draft_cache.kv_dtype, config.max_len) == ("int8", "bfloat16", 1024)
    assert (config.name, config.port, config.threads, config.ray) == ("m", 9000, 2, None)
    assert serve_flags(["--model", "x"]).name == "x"  # no --served-model-name: the model's


def test_a_server_keeps_prefixes_unless_told_not_to():
    """A conversation comes back with its history: serve's prefix cache is on by default (generate's is off)."""
    assert serve_flags(["--model", "x"]).cache.prefix_cache
    assert not serve_flags(["--model", "x", "--prefix-cache", "off"]).cache.prefix_cache


def test_ray_flags_make_the_ray_part():
    config = serve_flags(["--ray", "--replicas", "3", "--cpus-per-replica", "0.5", "--ingress-replicas", "2",
                          "--memory-per-replica", "2G", "--routing", "pow2", "--ray-address", "auto"])
    assert config.ray == RayConfig(replicas=3, cpus_per_replica=0.5, ingress_replicas=2,
                                   memory_per_replica=2 * 2 ** 30, routing="pow2", address="auto")


def test_the_config_survives_pickling():
    config = serve_flags(["--ray", "--drafter", "ngram", "--ngram", "2,4", "--kv-window", "64"])
    assert pickle.loads(pickle.dumps(config)) == config


@pytest.mark.parametrize("flags, message", [
    (["--drafter", "ngram", "--head", "h.safetensors"], "--head is only used by --drafter eagle|eagle-tree|medusa"),
    (["--drafter", "draft"], "--drafter draft needs --draft-model"),
    (["--kv-sinks", "2"], "--kv-sinks=2 needs a window"),
    (["--draft-kv-dtype", "int8"], "--draft-kv-dtype is only used with a draft model"),
    (["--max-running", "4", "--max-rows", "3"], "SchedulerConfig.max_rows"),
])
def test_contradictions_are_refused_before_anything_loads(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        serve_flags(["--model", str(tmp_path / "no-such-model"), *flags])


def test_bad_flags_are_a_value_error_not_an_exit():
    with pytest.raises(ValueError, match="bad specdecode serve flags: --routing random"):
        serve_flags(["--routing", "random"])


@pytest.mark.parametrize("settings, message", [
    (dict(routing="random"), "routing must be 'prefix' or 'pow2'"),
    (dict(replicas=0), "replicas and ingress_replicas must be >= 1"),
    (dict(cpus_per_replica=0.0), "cpus_per_replica > 0"),
])
def test_ray_config_refuses_what_ray_could_not_deploy(settings, message):
    with pytest.raises(ValueError, match=message):
        RayConfig(**settings)


def test_threads_default_to_the_usable_cores_and_the_flag_overrides(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(10)))
    assert serve_flags(["--model", "some.gguf"]).kernel_threads == 9
    assert serve_flags(["--model", "some.gguf", "--threads", "6"]).kernel_threads == 6


def test_a_server_open_to_others_without_a_key_is_warned_about_on_either_path():
    from specdecode.serve.command import open_port_warning

    for ray in ([], ["--ray"]):
        warning = open_port_warning(serve_flags(["--model", "x", "--host", "0.0.0.0", *ray]))
        assert warning is not None and "0.0.0.0 without an API key" in warning
        assert open_port_warning(serve_flags(["--model", "x", "--host", "0.0.0.0", "--api-key", "k", *ray])) is None
        assert open_port_warning(serve_flags(["--model", "x", *ray])) is None  # the default host: loopback
