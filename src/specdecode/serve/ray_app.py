"""``specdecode serve`` on Ray Serve: N engine replicas behind one OpenAI-compatible ingress.

Three deployments make the application (:func:`build_application`):

- ``EngineServer`` (``--replicas`` of them): each loads the model and runs the very server
  ``specdecode serve`` runs (``server.build_server``: the batch engine, its loop, the FastAPI app), and
  answers forwarded HTTP requests with it in-process (``forward.call_asgi``), streaming its body back
  chunk by chunk. It pushes its Prometheus text to the hub every second.
- ``Ingress`` (Ray Serve's HTTP proxy sends every request here): reads the request, hands it to an
  engine replica through a deployment handle, whose router (``ray_router.PrefixAffinityRouter``, or
  Ray's power of two choices with ``routing="pow2"``) picks the replica; relays the answer. A replica
  that died before anything reached the client (a non-streaming request, or a stream before its first
  generated token) is retried on another, up to ``retries`` times (with one replica, the retry waits for
  Ray to replace it); a stream cut later ends with an SSE error event naming the loss. ``/metrics``
  answers the hub's merged view.
- ``MetricsHub`` (one, no CPU): every replica's latest metrics, merged with a ``replica`` label.

Every replica is handed the command's :class:`~specdecode.serve.config.ServeConfig` (``flags.serve_flags``
makes one from a list of ``serve`` flags, for Python callers and config files). It does not own the Ray
cluster nor run the command (``ray_command.py``).
"""

import json
import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from specdecode.argtypes import byte_size
from specdecode.cores import bound_openmp_spin
from specdecode.serve.config import RayConfig, ServeConfig
from specdecode.serve.flags import serve_flags
from specdecode.serve.guard import UNAUTHORIZED, HttpPolicy, error_body
from specdecode.serve.forward import ForwardedRequest, ResponseHead, call_asgi
from specdecode.serve.metrics import merge_replicas
from specdecode.serve.server import SHUTDOWN_GRACE_S, build_server

APP_NAME = "specdecode"
METRICS_PUSH_S = 1.0  # how often a replica sends its metrics to the hub
METRICS_STALE_S = 15.0  # a replica silent this long (dead, removed) leaves the merged view
# Only a dead replica's request is retried: one merely unavailable (ActorUnavailableError) may still be
# running it, and a retry could answer it twice.
REPLICA_DIED = (ActorDiedError,)
REPLICA_HEADER = b"x-specdecode-replica"

log = logging.getLogger("specdecode.serve")


class EngineServer:
    """One replica: ``specdecode serve``'s server, answering forwarded requests.

    Args:
        config: the server's configuration.
        hub: the ``MetricsHub`` deployment.
        threads: the step kernels' threads (Ray's CPUs for the replica).
    """

    def __init__(self, config: ServeConfig, hub: DeploymentHandle, threads: int) -> None:
        from specdecode.models.build import resolve_device

        target = replace(config.target, device=resolve_device(config.target.device))  # this replica's device
        served = build_server(replace(config, target=target), log.info, threads=threads)
        self.app, self.loop, self.metrics = served.app, served.loop, served.metrics
        self.loop.start()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._hub, self._stop = hub, threading.Event()
        threading.Thread(target=self._push_metrics, name="specdecode-metrics", daemon=True).start()

    async def __call__(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """Answers one forwarded request: its :class:`ResponseHead` (with this replica's id), then its body."""
        async for item in call_asgi(self.app, request):
            if isinstance(item, ResponseHead):
                item.headers.append((REPLICA_HEADER, self.replica.encode()))
            yield item

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop stopped is replaced."""
        if not self.loop.alive:
            raise RuntimeError("the engine loop stopped")

    def _push_metrics(self) -> None:
        while not self._stop.wait(METRICS_PUSH_S):
            self._hub.push.remote(self.replica, self.metrics.render())

    def __del__(self) -> None:
        """Ray's graceful shutdown: running requests finish (``SHUTDOWN_GRACE_S``), the rest are cancelled."""
        if hasattr(self, "loop"):  # not when __init__ failed
            self._stop.set()
            self.loop.stop(timeout=SHUTDOWN_GRACE_S)


class MetricsHub:
    """The replicas' latest Prometheus texts, merged on demand."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, bytes]] = {}

    def push(self, replica: str, text: bytes) -> None:
        """Keeps ``replica``'s latest Prometheus text."""
        self._texts[replica] = (time.monotonic(), text)

    def render(self) -> bytes:
        """The fresh replicas' metrics as one exposition, each series labelled ``replica``."""
        now = time.monotonic()
        self._texts = {r: (t, text) for r, (t, text) in self._texts.items() if now - t < METRICS_STALE_S}
        return merge_replicas({r: text for r, (_, text) in sorted(self._texts.items())})


ingress_api = FastAPI(title="specdecode (Ray Serve)", docs_url=None, redoc_url=None)


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind=kind), status_code=status, headers=headers)


def _began(chunk: bytes) -> bool:
    """Whether an SSE chunk of ours carries generated text, an end or an error (anything but the chat
    stream's role preamble, which is sent before the first token)."""
    for line in chunk.decode(errors="replace").splitlines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            return True
        try:
            event = json.loads(data)
        except ValueError:
            return True
        if "error" in event or not event.get("choices"):
            return True
        choice = event["choices"][0]
        if choice.get("finish_reason") or choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


def _headers(head: ResponseHead) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in head.headers if k.lower() != b"content-length"}


async def answer(engine: Any, forwarded: ForwardedRequest, retries: int) -> Response:
    """``forwarded``'s answer from a replica behind the streaming handle ``engine``: retried up to
    ``retries`` times while a replica dies before anything was sent (a stream's bytes are held back until
    its first generated token), relayed as a stream after that."""
    for attempt in range(1 + retries):
        stream = engine.remote(forwarded)
        relaying = False
        try:
            head: ResponseHead = await stream.__anext__()
            held: list[bytes] = []
            if head.status == 200 and forwarded.streams:
                async for chunk in stream:
                    held.append(chunk)
                    if _began(chunk):
                        break
                relaying = True
                return StreamingResponse(_relay(stream, held), status_code=head.status, headers=_headers(head))
            body = b"".join([chunk async for chunk in stream])
            return Response(body, status_code=head.status, headers=_headers(head))
        except REPLICA_DIED as exc:
            log.warning("a replica died before answering %s %s (attempt %d): %s", forwarded.method, forwarded.path,
                        attempt + 1, exc)
        except BackPressureError as exc:
            return _error(429, f"every replica's queue is full: {exc}", "rate_limit_exceeded", {"Retry-After": "1"})
        except StopAsyncIteration:
            return _error(500, "the replica answered nothing", "server_error")
        except Exception as exc:  # a replica unavailable, a deployment gone...: not retried (REPLICA_DIED)
            return _error(503, f"the request could not be served: {type(exc).__name__}: {exc}", "service_unavailable")
        finally:
            if not relaying:  # answered, failed or the client went away: the replica's request ends
                stream.cancel()
    return _error(503, f"the replica serving this request died {1 + retries} times; nothing was generated",
                  "service_unavailable")


async def _relay(stream: Any, held: list[bytes]) -> AsyncIterator[bytes | str]:
    """A stream's chunks: those held back, then the rest; a failure ends it with an SSE error event."""
    try:
        for chunk in held:
            yield chunk
        async for chunk in stream:
            yield chunk
    except Exception as exc:
        lost = "died" if isinstance(exc, REPLICA_DIED) else f"failed ({type(exc).__name__})"
        message = f"the replica serving this request {lost} mid-stream; the answer is incomplete"
        yield f"data: {json.dumps(error_body(message, kind='server_error'))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        stream.cancel()  # a client that went away cancels the replica's request (and frees its KV slot)


# Decorated here because Ray Serve binds the FastAPI routes at class definition (and serializes the class
# then: what its methods call must be defined above); its options are set in build_application.
@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
                  graceful_shutdown_timeout_s=SHUTDOWN_GRACE_S + 5)
@serve.ingress(ingress_api)
class Ingress:
    """The HTTP face of the application (see the module docstring).

    Args:
        engine: the ``EngineServer`` deployment.
        hub: the ``MetricsHub`` deployment.
        retries: attempts after the first when a replica dies before anything was sent.
        policy: the API key; the replicas check it on the routes they answer, this ingress on ``/metrics``.
    """

    def __init__(self, engine: DeploymentHandle, hub: DeploymentHandle, retries: int = 2,
                 policy: HttpPolicy = HttpPolicy()) -> None:
        self.engine, self.hub, self.retries, self.policy = engine.options(stream=True), hub, retries, policy

    @ingress_api.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Every replica's metrics in one view."""
        from prometheus_client import CONTENT_TYPE_LATEST

        refused = self._refused("/metrics", request)
        return refused or Response(await self.hub.render.remote(), media_type=CONTENT_TYPE_LATEST)

    @ingress_api.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, path: str, request: Request) -> Response:
        """Any other request: to an engine replica (:func:`answer`)."""
        refused = self._refused("/" + path, request)  # here too: an unkeyed or huge body never crosses Ray
        if refused is not None:
            return refused
        body, size, limit = [], 0, self.policy.max_body_bytes
        async for part in request.stream():
            body.append(part)
            size += len(part)
            if size > limit:
                return JSONResponse(error_body(f"the request body is over the {limit} bytes this server takes"),
                                    status_code=413)
        forwarded = ForwardedRequest.build(request.method, "/" + path, request.url.query.encode(),
                                           list(request.headers.raw), b"".join(body))
        return await answer(self.engine, forwarded, self.retries)

    def _refused(self, path: str, request: Request) -> Response | None:
        """The 401 for a request without the API key, or None."""
        if self.policy.allows(path, request.headers.get("authorization")):
            return None
        return JSONResponse(error_body(UNAUTHORIZED, "invalid_api_key"), status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})


def build_application(config: ServeConfig, replicas: int = 1, cpus_per_replica: float = 1.0,
                      routing: str = "prefix", retries: int = 2, memory_per_replica: int | None = None,
                      ingress_replicas: int = 1) -> serve.Application:
    """The Ray Serve application serving ``config`` (its ``ray`` part aside: the deployment is given here).

    Args:
        config: the server (``flags.serve_flags`` makes one from a list of flags); its ``threads`` sets the
            step kernels' threads per replica (default: ``cpus_per_replica``, at least 1).
        replicas: engine replicas.
        cpus_per_replica: Ray CPUs each replica reserves.
        routing: ``prefix`` (prefix affinity within a load bound) or ``pow2`` (Ray's default).
        retries: see :class:`Ingress`.
        memory_per_replica: bytes each replica reserves from Ray's scheduler (None: none).
        ingress_replicas: ingress replicas (with Ray's proxy, ~445 streamed chunks per CPU second here, see
            BENCHMARKS.md, "Ray Serve"; each keeps its own prefix index).
    """
    ray = RayConfig(replicas, cpus_per_replica, ingress_replicas, memory_per_replica, routing, retries)
    threads = config.threads or max(1, int(ray.cpus_per_replica))
    scheduler = config.scheduler
    router = {}
    if ray.routing == "prefix":
        from specdecode.serve.ray_router import PrefixAffinityRouter

        router = {"request_router_config": RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"imbalance": max(1, scheduler.max_running // 2)})}
    hub = serve.deployment(MetricsHub, name="MetricsHub", ray_actor_options={"num_cpus": 0},
                           logging_config={"enable_access_log": False}).bind()  # a push per replica per second
    # The replicas spin as the command line bounds it (a user's own spin count or wait policy kept), also where
    # this application is built without the command line (Ray's `serve run`) or runs on a remote cluster.
    spin = {k: os.environ[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if k in os.environ}
    bound_openmp_spin(spin)
    actor = {"num_cpus": ray.cpus_per_replica, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads), **spin}}}
    if ray.memory_per_replica:
        actor["memory"] = ray.memory_per_replica
    engine = serve.deployment(
        EngineServer, name="EngineServer", num_replicas=ray.replicas, ray_actor_options=actor,
        max_ongoing_requests=scheduler.max_running + scheduler.max_waiting,
        max_queued_requests=max(1, scheduler.max_waiting),
        health_check_period_s=2, max_constructor_retry_count=2,  # one retry in all, then the deployment fails
        graceful_shutdown_timeout_s=SHUTDOWN_GRACE_S + 5, **router,
    ).bind(config, hub, threads)
    return Ingress.options(num_replicas=ray.ingress_replicas).bind(engine, hub, ray.retries, config.http)


class DeploymentError(RuntimeError):
    """The application did not come up; the message names the failing deployment's own error."""


def run_application(application: serve.Application, name: str = APP_NAME, route_prefix: str = "/") -> None:
    """``serve.run``, but a failed deployment raises :class:`DeploymentError` with the error its replicas
    raised (for example the model that could not be loaded), not only that it failed."""
    try:
        serve.run(application, name=name, route_prefix=route_prefix)
    except RuntimeError as exc:
        status = serve.status().applications.get(name)
        failed = [(d, s.message) for d, s in (status.deployments.items() if status else ())
                  if s.status in ("DEPLOY_FAILED", "UNHEALTHY") and s.message]
        if not failed:
            raise DeploymentError(str(exc)) from None
        deployment, message = failed[0]
        raise DeploymentError(f"deployment {deployment} failed: {_last_error_line(message)}") from None


def _last_error_line(message: str) -> str:
    """The innermost ``SomeError: ...`` line of a replica's traceback (the message itself if none)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if line.split(":", 1)[0].rsplit(".", 1)[-1].endswith(("Error", "Exception"))]
    return (errors or lines or [message])[-1]


def app_builder(config: dict[str, Any]) -> serve.Application:
    """For a Ray Serve config file (``import_path: specdecode.serve.ray_app:app_builder``), with ``args``:
    ``flags`` (a list of ``specdecode serve`` flags), ``replicas``, ``cpus_per_replica``, ``routing``,
    ``retries``, ``memory_per_replica`` (bytes or a size such as ``2G``), ``ingress_replicas``."""
    unknown = set(config) - {"flags", "replicas", "cpus_per_replica", "routing", "retries", "memory_per_replica",
                             "ingress_replicas"}
    if unknown:
        raise ValueError(f"unknown app_builder args: {', '.join(sorted(unknown))}")
    memory = config.get("memory_per_replica")
    return build_application(serve_flags(list(config.get("flags", []))), int(config.get("replicas", 1)),
                             float(config.get("cpus_per_replica", 1.0)), config.get("routing", "prefix"),
                             int(config.get("retries", 2)), byte_size(str(memory)) if memory is not None else None,
                             int(config.get("ingress_replicas", 1)))
