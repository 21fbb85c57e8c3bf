"""A Ray Serve request router that sends requests sharing a prompt prefix to the replica that served it.

Ray Serve routes by "power of two choices" (two random replicas, the shorter queue wins), prefers
replicas on the caller's node, and can keep requests with the same multiplexed model id on one replica;
Ray Serve LLM adds a prefix-aware router for its own request types. This router does the same for the
engine replicas (``ray_app.py``): where a request's text shares at least ``min_match_chars`` with one a
replica served recently (a :class:`~specdecode.serve.prefix_index.PrefixIndex`) and that replica's queue
is at most ``imbalance`` longer than the shortest, it goes there (its prefix cache and n-gram history
are there); otherwise, and when the chosen replica is full, power of two choices decides.

The index lives in the router, i.e. in each ingress replica's process: with several ingress replicas
each learns from what it routed. It does not read replicas' caches, and it only sees
:class:`~specdecode.serve.forward.ForwardedRequest` arguments (other calls are routed as Ray would).
"""

from __future__ import annotations

import random
from typing import List, Optional

from ray.serve.request_router import (LocalityMixin, PendingRequest, ReplicaID, ReplicaResult, RequestRouter,
                                      RunningReplica)

from specdecode.serve.forward import ForwardedRequest
from specdecode.serve.prefix_index import PrefixIndex


def _text(pending: Optional[PendingRequest]) -> str:
    if pending is None:
        return ""
    return next((a.routing_text for a in pending.args if isinstance(a, ForwardedRequest)), "")


class PrefixAffinityRouter(LocalityMixin, RequestRouter):
    """Prefix affinity within a load bound, else power of two choices (see the module docstring). Not
    FIFO (Ray's ``FIFOMixin``): that would hand the replica chosen for one request to an older one."""

    def initialize_state(self, min_match_chars: int = 32, imbalance: int = 2, per_replica: int = 256) -> None:
        """Ray calls this with the deployment's ``request_router_kwargs`` (an unknown name is a TypeError).

        Args:
            min_match_chars: characters a request must share with a replica's recent text to go there.
            imbalance: how much longer than the shortest queue the affine replica's may be.
            per_replica: texts remembered per replica.
        """
        self.min_match_chars, self.imbalance = min_match_chars, imbalance
        self.index = PrefixIndex(per_replica)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        """The affine replicas (longest shared prefix, within the load bound) first, then two random ones."""
        ids = self.apply_locality_routing(pending_request=pending_request)  # also decides when to back off
        candidates = [self._replicas[i] for i in ids if i in self._replicas]
        if not candidates:
            return []
        two = random.sample(candidates, min(2, len(candidates)))
        text = _text(pending_request)
        if not text:
            return [two]
        queues = {r.replica_id: self._replica_queue_len_cache.get(r.replica_id) or 0 for r in candidates}
        affine = [self._replicas[i] for i in self.index.affine(text, queues, self.min_match_chars, self.imbalance)]
        return [affine, two] if affine else [two]  # the second rank when the affine replicas are full

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        self.index.record(replica_id, _text(pending_request))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)
