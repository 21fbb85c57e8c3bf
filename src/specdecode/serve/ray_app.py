"""``specdecode serve`` on Ray Serve: N engine replicas behind one OpenAI-compatible ingress.

Three deployments make the application (:func:`build_application`):

- ``EngineServer`` (``--replicas`` of them): each loads the model and runs the very server
  ``specdecode serve`` runs (``command.build_server``: the batch engine, its loop, the FastAPI app), and
  answers forwarded HTTP requests with it in-process (``forward.call_asgi``), streaming its body back
  chunk by chunk. It pushes its Prometheus text to the hub every second.
- ``Ingress`` (Ray Serve's HTTP proxy sends every request here): reads the request, hands it to an
  engine replica through a deployment handle, whose router (``ray_router.PrefixAffinityRouter``, or
  Ray's power of two choices with ``routing="pow2"``) picks the replica; relays the answer. A replica
  lost before anything reached the client (a non-streaming request, or a stream before its first
  generated token) is retried on another, up to ``retries`` times; a stream cut later ends with an SSE
  error event naming the loss. ``/metrics`` answers the hub's merged view.
- ``MetricsHub`` (one, no CPU): every replica's latest metrics, merged with a ``replica`` label.

It does not parse command lines or own the Ray cluster (``ray_command.py``).
"""

import argparse
import asyncio
import json
import logging
import threading
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from specdecode.serve.forward import ForwardedRequest, ResponseHead, call_asgi

APP_NAME = "specdecode"
METRICS_PUSH_S = 1.0  # how often a replica sends its metrics to the hub
METRICS_STALE_S = 15.0  # a replica silent this long (dead, removed) leaves the merged view
REPLICA_LOST = (RayActorError,)  # ActorDiedError, ActorUnavailableError
REPLICA_HEADER = b"x-specdecode-replica"

log = logging.getLogger("specdecode.serve")


class EngineServer:
    """One replica: ``specdecode serve``'s server, answering forwarded requests.

    Args:
        args: ``specdecode serve``'s parsed flags.
        hub: the ``MetricsHub`` deployment.
        threads: the step kernels' threads (Ray's CPUs for the replica).
    """

    def __init__(self, args: argparse.Namespace, hub: DeploymentHandle, threads: int) -> None:
        import torch

        from specdecode.models.build import resolve_device
        from specdecode.serve.command import build_server

        torch.set_num_threads(threads)
        args.device = resolve_device(args.device)
        served = build_server(args, log.info)
        self.app, self.loop, self.metrics = served.app, served.loop, served.metrics
        self.loop.start()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._hub, self._stop = hub, threading.Event()
        threading.Thread(target=self._push_metrics, name="specdecode-metrics", daemon=True).start()

    async def __call__(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
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
        from specdecode.serve.command import SHUTDOWN_GRACE_S

        if hasattr(self, "loop"):  # not when __init__ failed
            self._stop.set()
            self.loop.stop(timeout=SHUTDOWN_GRACE_S)


class MetricsHub:
    """The replicas' latest Prometheus texts, merged on demand."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, bytes]] = {}

    def push(self, replica: str, text: bytes) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def render(self) -> bytes:
        from specdecode.serve.metrics import merge_replicas

        now = time.monotonic()
        self._texts = {r: (t, text) for r, (t, text) in self._texts.items() if now - t < METRICS_STALE_S}
        return merge_replicas({r: text for r, (_, text) in sorted(self._texts.items())})


ingress_api = FastAPI(title="specdecode (Ray Serve)", docs_url=None, redoc_url=None)


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                        status_code=status, headers=headers)


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


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(ingress_api)
class Ingress:
    """The HTTP face of the application (see the module docstring).

    Args:
        engine: the ``EngineServer`` deployment.
        hub: the ``MetricsHub`` deployment.
        retries: attempts after the first when a replica is lost before anything was sent.
    """

    def __init__(self, engine: DeploymentHandle, hub: DeploymentHandle, retries: int = 2) -> None:
        self.engine, self.hub, self.retries = engine, hub, retries

    @ingress_api.get("/metrics")
    async def metrics(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await self.hub.render.remote(), media_type=CONTENT_TYPE_LATEST)

    @ingress_api.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, path: str, request: Request) -> Response:
        forwarded = ForwardedRequest.build(request.method, request.url.path, request.url.query.encode(),
                                           list(request.headers.raw), await request.body())
        lost: Exception | None = None
        for _ in range(1 + self.retries):
            stream = self.engine.options(stream=True).remote(forwarded)
            try:
                head: ResponseHead = await stream.__anext__()
                held: list[bytes] = []
                if head.status == 200 and forwarded.streams:
                    async for chunk in stream:  # held back until a token comes: until then a loss is retried
                        held.append(chunk)
                        if _began(chunk):
                            break
                    return StreamingResponse(self._relay(stream, held), status_code=head.status, headers=_headers(head))
                body = b"".join([chunk async for chunk in stream])
                return Response(body, status_code=head.status, headers=_headers(head))
            except REPLICA_LOST as exc:
                stream.cancel()
                lost = exc
                log.warning("a replica was lost before answering %s %s; retrying: %s", request.method, path, exc)
            except BackPressureError as exc:
                return _error(429, f"every replica's queue is full: {exc}", "rate_limit_exceeded", {"Retry-After": "1"})
            except StopAsyncIteration:
                return _error(500, "the replica answered nothing", "server_error")
            except asyncio.CancelledError:  # the client went away
                stream.cancel()
                raise
        return _error(503, f"the replica serving this request was lost {1 + self.retries} times "
                           f"({type(lost).__name__}); nothing was generated", "service_unavailable")

    async def _relay(self, stream: Any, held: list[bytes]) -> AsyncIterator[bytes]:
        try:
            for chunk in held:
                yield chunk
            async for chunk in stream:
                yield chunk
        except REPLICA_LOST as exc:
            message = f"the replica serving this request was lost mid-stream ({type(exc).__name__}); the answer is incomplete"
            yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error', 'param': None, 'code': None}})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            stream.cancel()  # a client that went away cancels the replica's request (and frees its KV slot)


def build_application(args: argparse.Namespace, replicas: int = 1, cpus_per_replica: float = 1.0,
                      routing: str = "prefix", retries: int = 2, memory_per_replica: int | None = None,
                      ingress_replicas: int = 1) -> serve.Application:
    """The Ray Serve application for ``specdecode serve``'s flags ``args``.

    Args:
        args: parsed ``specdecode serve`` flags (:func:`serve_flags` parses a list); ``--threads`` sets the
            step kernels' threads per replica (default: ``cpus_per_replica``, at least 1).
        replicas: engine replicas.
        cpus_per_replica: Ray CPUs each replica reserves.
        routing: ``prefix`` (prefix affinity within a load bound) or ``pow2`` (Ray's default).
        retries: see :class:`Ingress`.
        memory_per_replica: bytes each replica reserves from Ray's scheduler (None: none).
        ingress_replicas: ingress replicas (each relays ~450 chunks per CPU second here; see BENCHMARKS.md).
    """
    if routing not in ("prefix", "pow2"):
        raise ValueError(f"routing must be 'prefix' or 'pow2'; got {routing!r}")
    if replicas < 1 or ingress_replicas < 1 or cpus_per_replica <= 0:
        raise ValueError(f"replicas and ingress_replicas must be >= 1 and cpus_per_replica > 0; got {replicas}, "
                         f"{ingress_replicas} and {cpus_per_replica}")
    threads = args.threads or max(1, int(cpus_per_replica))
    router = {}
    if routing == "prefix":
        from specdecode.serve.ray_router import PrefixAffinityRouter

        router = {"request_router_config": RequestRouterConfig(
            request_router_class=PrefixAffinityRouter, request_router_kwargs={"imbalance": max(1, args.max_running // 2)})}
    hub = serve.deployment(MetricsHub, name="MetricsHub", ray_actor_options={"num_cpus": 0},
                           logging_config={"enable_access_log": False}).bind()  # a push per replica per second
    actor = {"num_cpus": cpus_per_replica, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}}
    if memory_per_replica:
        actor["memory"] = memory_per_replica
    engine = serve.deployment(
        EngineServer, name="EngineServer", num_replicas=replicas, ray_actor_options=actor,
        max_ongoing_requests=args.max_running + args.max_waiting, max_queued_requests=max(1, args.max_waiting),
        health_check_period_s=2, max_constructor_retry_count=1, **router,
    ).bind(args, hub, threads)
    return Ingress.options(num_replicas=ingress_replicas).bind(engine, hub, retries)


class DeploymentError(RuntimeError):
    """The application did not come up; the message names the failing deployment's own error."""


def run_application(application: serve.Application, name: str = APP_NAME, route_prefix: str = "/") -> None:
    """``serve.run``, but a failed deployment raises :class:`DeploymentError` with the error its replicas
    raised (for example the model that could not be loaded), not only that it failed."""
    try:
        serve.run(application, name=name, route_prefix=route_prefix)
    except RuntimeError as exc:
        status = serve.status().applications.get(name)
        failed = [(d, s.message) for d, s in (status.deployments.items() if status else ()) if s.message]
        if not failed:
            raise DeploymentError(str(exc)) from None
        deployment, message = failed[0]
        raise DeploymentError(f"deployment {deployment} failed: {_last_error_line(message)}") from None


def _last_error_line(message: str) -> str:
    """The innermost ``SomeError: ...`` line of a replica's traceback (the message itself if none)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if line.split(":", 1)[0].rsplit(".", 1)[-1].endswith(("Error", "Exception"))]
    return (errors or lines or [message])[-1]


def serve_flags(flags: list[str]) -> argparse.Namespace:
    """``specdecode serve``'s flags (e.g. ``["--model", "smollm2-135m", "--drafter", "ngram"]``), parsed."""
    from specdecode.cli import build_parser

    return build_parser().parse_args(["serve", *flags])


def app_builder(config: dict[str, Any]) -> serve.Application:
    """For a Ray Serve config file (``import_path: specdecode.serve.ray_app:app_builder``), with ``args``:
    ``flags`` (a list of ``specdecode serve`` flags), ``replicas``, ``cpus_per_replica``, ``routing``,
    ``retries``, ``memory_per_replica`` (bytes), ``ingress_replicas``."""
    unknown = set(config) - {"flags", "replicas", "cpus_per_replica", "routing", "retries", "memory_per_replica",
                             "ingress_replicas"}
    if unknown:
        raise ValueError(f"unknown app_builder args: {', '.join(sorted(unknown))}")
    return build_application(serve_flags(list(config.get("flags", []))), int(config.get("replicas", 1)),
                             float(config.get("cpus_per_replica", 1.0)), config.get("routing", "prefix"),
                             int(config.get("retries", 2)), config.get("memory_per_replica"),
                             int(config.get("ingress_replicas", 1)))
