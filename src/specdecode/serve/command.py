"""``specdecode serve``: run the server a :class:`~specdecode.serve.config.ServeConfig` describes with uvicorn,
or on Ray Serve (``ray_command.py``) when it has a Ray part.

It does not parse flags (``flags.py``), build the server (``server.py``), define the API (``app.py``) or
step the engine (``loop.py``).
"""

from __future__ import annotations

import gc
from contextlib import asynccontextmanager
from typing import Callable

from specdecode.serve.config import ServeConfig
from specdecode.serve.server import SHUTDOWN_GRACE_S, build_server

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@asynccontextmanager
async def _lifespan(app):
    """The engine loop runs while uvicorn serves; at shutdown new requests are refused and running ones
    may finish for ``SHUTDOWN_GRACE_S``."""
    served = app.state.served
    served.loop.start()
    yield
    served.accepting = False
    served.loop.stop(timeout=SHUTDOWN_GRACE_S)


def open_port_warning(config: ServeConfig) -> str | None:
    """The warning a server gets that anyone who reaches its port may use (no API key, not on loopback)."""
    if config.http.api_key is not None or config.host in LOOPBACK:
        return None
    return (f"warning: listening on {config.host} without an API key: anyone who reaches the port can use the "
            "server (--api-key)")


def run_command(config: ServeConfig, log: Callable[[str], None]) -> int:
    """Serves until SIGINT or SIGTERM; exit status 0.

    Raises:
        ValueError: the serve (or ray) extra is missing, or the server cannot be built.
    """
    warning = open_port_warning(config)
    if warning is not None:
        log(warning)
    if config.ray is not None:
        from specdecode.serve.ray_command import run_ray

        return run_ray(config, log)
    try:
        import uvicorn
    except ImportError as exc:
        raise ValueError(f"specdecode serve needs the serve extra ({exc.name} is missing): "
                         "pip install 'specdecode[serve]'") from None
    served = build_server(config, log, lifespan=_lifespan)
    gc.collect()
    gc.freeze()  # the model and engine live as long as the server: keep them out of every collection's scan
    log(f"serving {served.name} on http://{config.host}:{config.port}/v1 (drafter {served.kind}, "
        f"gamma {config.speculation.gamma}, {config.kernel_threads} kernel thread(s))")
    uvicorn.run(served.app, host=config.host, port=config.port, log_level=config.log_level,
                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    return 0
