"""``specdecode serve --ray``: join (or start) a Ray cluster, deploy ``ray_app``'s application behind Ray
Serve's HTTP proxy on ``--host``/``--port``, and serve until SIGINT or SIGTERM.

Without ``--ray-address`` (or ``$RAY_ADDRESS``) it starts a local cluster of this machine's cores and
shuts it down on exit, leaving no Ray process behind; on a cluster it joined (``--ray-address auto`` for
one ``ray start`` began here) only its application is deleted. It does not define the deployments (``ray_app.py``).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

from specdecode.serve.config import ServeConfig


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM as SIGINT: the clean-up below runs for both


def run_ray(config: ServeConfig, log: Callable[[str], None]) -> int:
    """Deploys ``config`` (its ``ray`` part set) on Ray Serve and serves until SIGINT or SIGTERM (module docstring).

    Raises:
        ValueError: Ray is missing, the cluster lacks the CPUs, an application of this name already runs
            there, or the deployment failed (with its replicas' error).
    """
    try:
        import ray
        from ray import serve

        from specdecode.serve.ray_app import APP_NAME, DeploymentError, build_application, run_application
    except ImportError as exc:
        raise ValueError(f"specdecode serve --ray needs Ray Serve ({exc.name} is missing): "
                         "pip install 'specdecode[ray]'") from None
    ray_config = config.ray
    application = build_application(config, ray_config.replicas, ray_config.cpus_per_replica, ray_config.routing,
                                    ray_config.retries, ray_config.memory_per_replica, ray_config.ingress_replicas)
    address = ray_config.address or os.environ.get("RAY_ADDRESS")
    own_cluster = address is None
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    deployed = False
    try:
        if own_cluster:  # a cluster of this machine's cores for this server alone
            ray.init(address="local", include_dashboard=False, log_to_driver=config.log_level == "debug")
        else:
            ray.init(address=address, log_to_driver=config.log_level == "debug")
        for sig in previous:  # again: Ray's core worker installs its own SIGTERM handler, which exits at once
            signal.signal(sig, _interrupt)
        cpus = ray.available_resources().get("CPU", 0)
        needed = ray_config.replicas * ray_config.cpus_per_replica
        if needed > cpus + 1e-6:  # Ray would wait for them forever
            raise ValueError(f"{ray_config.replicas} replica(s) of {ray_config.cpus_per_replica:g} CPU need "
                             f"{needed:g} CPUs; the Ray cluster has {cpus:g} free")
        serve.start(http_options={"host": config.host, "port": config.port})
        if APP_NAME in serve.status().applications:
            raise ValueError(f"an application named {APP_NAME!r} already runs on this Ray cluster; "
                             f"stop it first (serve.delete({APP_NAME!r}))")
        log(f"deploying {ray_config.replicas} replica(s) of {config.name} on Ray "
            f"({ray_config.cpus_per_replica:g} CPU each, routing {ray_config.routing}) ...")
        deployed = True  # from here on, what was deployed is deleted on the way out
        try:
            run_application(application)
        except DeploymentError as exc:
            raise ValueError(str(exc)) from None
        log(f"serving on http://{config.host}:{config.port}/v1 through Ray Serve; Ctrl-C or SIGTERM stops")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        log("stopping ...")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # a second signal now interrupts the clean-up itself
        if ray.is_initialized():
            if deployed:
                serve.delete(APP_NAME)
            if own_cluster:
                serve.shutdown()
            ray.shutdown()
    return 0
