"""``specdecode serve --ray``: join (or start) a Ray cluster, deploy ``ray_app``'s application behind Ray
Serve's HTTP proxy on ``--host``/``--port``, and serve until SIGINT or SIGTERM.

Without ``--ray-address`` (or ``$RAY_ADDRESS``) it starts a local cluster of this machine's cores and
shuts it down on exit, leaving no Ray process behind; on a cluster it joined (``--ray-address auto`` for
one ``ray start`` began here) only its application is deleted. It does not define the deployments (``ray_app.py``).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Callable


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM as SIGINT: the clean-up below runs for both


def run_ray(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    """Deploys ``serve``'s flags ``args`` on Ray Serve and serves until SIGINT or SIGTERM (module docstring).

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
    application = build_application(args, args.replicas, args.cpus_per_replica, args.routing,
                                    memory_per_replica=args.memory_per_replica,
                                    ingress_replicas=args.ingress_replicas)
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    own_cluster = address is None
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    deployed = False
    try:
        if own_cluster:  # a cluster of this machine's cores for this server alone
            ray.init(address="local", include_dashboard=False, log_to_driver=args.log_level == "debug")
        else:
            ray.init(address=address, log_to_driver=args.log_level == "debug")
        for sig in previous:  # again: Ray's core worker installs its own SIGTERM handler, which exits at once
            signal.signal(sig, _interrupt)
        cpus = ray.available_resources().get("CPU", 0)
        if args.replicas * args.cpus_per_replica > cpus + 1e-6:  # Ray would wait for them forever
            raise ValueError(f"{args.replicas} replica(s) of {args.cpus_per_replica:g} CPU need "
                             f"{args.replicas * args.cpus_per_replica:g} CPUs; the Ray cluster has {cpus:g} free")
        serve.start(http_options={"host": args.host, "port": args.port})
        if APP_NAME in serve.status().applications:
            raise ValueError(f"an application named {APP_NAME!r} already runs on this Ray cluster; "
                             f"stop it first (serve.delete({APP_NAME!r}))")
        log(f"deploying {args.replicas} replica(s) of {args.served_model_name or args.model} on Ray "
            f"({args.cpus_per_replica:g} CPU each, routing {args.routing}) ...")
        deployed = True  # from here on, what was deployed is deleted on the way out
        try:
            run_application(application)
        except DeploymentError as exc:
            raise ValueError(str(exc)) from None
        log(f"serving on http://{args.host}:{args.port}/v1 through Ray Serve; Ctrl-C or SIGTERM stops")
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
