"""What ``specdecode serve`` serves and how, as frozen (picklable) configs: :class:`ServeConfig` and, behind
Ray Serve, :class:`RayConfig`. A Ray replica is handed the very ``ServeConfig`` the command built.

It holds and checks settings; it neither parses flags (``flags.py``) nor builds the server (``server.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.batch.scheduler import SchedulerConfig
from specdecode.cores import server_threads
from specdecode.serve.guard import HttpPolicy
from specdecode.drafter_setup import DrafterConfig
from specdecode.control.config import SpeculativeConfig
from specdecode.kv.cache import CacheConfig
from specdecode.target import TargetConfig

ROUTINGS = ("prefix", "pow2")


@dataclass(frozen=True)
class RayConfig:
    """The deployment on Ray Serve (``serve --ray``).

    Args:
        replicas: engine replicas.
        cpus_per_replica: Ray CPUs each replica reserves (its kernels' threads unless ``--threads``).
        ingress_replicas: replicas of the ingress that relays every request and streamed chunk.
        memory_per_replica: bytes each replica reserves from Ray's scheduler (None: none).
        routing: ``prefix`` (prefix affinity within a load bound) or ``pow2`` (Ray's power of two choices).
        retries: attempts after the first when a replica dies before anything was sent.
        address: the cluster to join (``auto``, ``HOST:PORT``); None = ``$RAY_ADDRESS``, else a new local one.

    Raises:
        ValueError: an unknown routing, or fewer than one replica or CPU.
    """

    replicas: int = 1
    cpus_per_replica: float = 1.0
    ingress_replicas: int = 1
    memory_per_replica: int | None = None
    routing: str = "prefix"
    retries: int = 2
    address: str | None = None

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be 'prefix' or 'pow2'; got {self.routing!r}")
        if self.replicas < 1 or self.ingress_replicas < 1 or self.cpus_per_replica <= 0:
            raise ValueError(f"replicas and ingress_replicas must be >= 1 and cpus_per_replica > 0; got {self.replicas}, "
                             f"{self.ingress_replicas} and {self.cpus_per_replica}")


@dataclass(frozen=True)
class ServeConfig:
    """One server: the model and drafter it serves, how it decodes and batches, where it listens.

    Args:
        target: the target model and how it is loaded.
        drafter: the drafter (one per KV slot).
        speculation: gamma or its controller.
        cache: the target's KV cache settings.
        draft_cache: the draft model's (or EAGLE head's) KV cache settings.
        scheduler: requests decoded together and queued, rows per forward.
        max_len: tokens per request, prompt + completion; None = the model's context, at most 4096.
        served_model_name: the name clients pass as ``model``; None = ``target.model``.
        host: address to listen on.
        port: TCP port.
        log_level: uvicorn's (and, at ``debug``, Ray's driver logs).
        threads: the step kernels' threads; None = :func:`server_threads` (on Ray: ``cpus_per_replica``).
        ray: the Ray Serve deployment, or None to serve in this process.
        http: the API key, the request body limit and the per-request deadline.
    """

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    speculation: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    draft_cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_len: int | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    threads: int | None = None
    ray: RayConfig | None = None
    http: HttpPolicy = field(default_factory=HttpPolicy)

    @property
    def name(self) -> str:
        """The model name clients pass."""
        return self.served_model_name or self.target.model

    @property
    def kernel_threads(self) -> int:
        """The step kernels' threads in this process: ``threads``, else :func:`server_threads`."""
        return self.threads or server_threads()
