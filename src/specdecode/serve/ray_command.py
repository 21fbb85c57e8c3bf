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
import threading
from typing import Callable


def run_ray(args: argparse.Namespace, log: Callable[[str], None]) -> int:
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
    if own_cluster:  # a cluster of this machine's cores for this server alone
        ray.init(address="local", include_dashboard=False, log_to_driver=args.log_level == "debug")
    else:
        ray.init(address=address, log_to_driver=args.log_level == "debug")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cpus = ray.available_resources().get("CPU", 0)
        if args.replicas * args.cpus_per_replica > cpus:  # Ray would wait for them forever
            raise ValueError(f"{args.replicas} replica(s) of {args.cpus_per_replica:g} CPU need "
                             f"{args.replicas * args.cpus_per_replica:g} CPUs; the Ray cluster has {cpus:g} free")
        serve.start(http_options={"host": args.host, "port": args.port})
        log(f"deploying {args.replicas} replica(s) of {args.served_model_name or args.model} on Ray "
            f"({args.cpus_per_replica:g} CPU each, routing {args.routing}) ...")
        try:
            run_application(application)
        except DeploymentError as exc:
            raise ValueError(str(exc)) from None
        log(f"serving on http://{args.host}:{args.port}/v1 through Ray Serve; Ctrl-C or SIGTERM stops")
        stop.wait()
        log("stopping ...")
    finally:
        serve.delete(APP_NAME)
        if own_cluster:
            serve.shutdown()
        ray.shutdown()
    return 0
