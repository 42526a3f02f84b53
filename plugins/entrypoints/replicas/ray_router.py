"""Ray Serve's request router for engine replicas, deciding through a pagoda router component.

Ray Serve builds one in every process that holds a handle to the engine deployment (the ingress);
it sees each request's :class:`~.forward.ForwardedRequest` before the request is sent. Loads are the
requests this router has in flight on each replica. The router's choice is tried first, then the
other replicas from the least loaded, so a full replica does not hold a request back.
"""

from __future__ import annotations

from typing import Any, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from pagoda.plugin_manager import get_plugin_manager
from pagoda.plugins.entrypoints.replicas.forward import NO_PROMPT, ForwardedRequest
from pagoda.routing import ReplicaLoad, make_router


class PagodaRequestRouter(RequestRouter):
    """Routes through the pagoda router ``router`` built with ``router_options``."""

    def initialize_state(self, router: str = "prefix-aware", router_options: Optional[dict] = None,
                         **_: Any) -> None:
        self.router = make_router(router, router_options, get_plugin_manager())
        self.num_in_flight: dict[ReplicaID, int] = {}
        self.in_flight: dict[str, ReplicaID] = {}  # internal request id -> replica

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        forwarded = _forwarded(pending_request)
        if forwarded is not None:
            forwarded.replica_names = [r.replica_id.unique_id for r in candidate_replicas]
            if forwarded.target is not None:
                return [[r for r in candidate_replicas if r.replica_id.unique_id == forwarded.target]]
        routing = forwarded.routing if forwarded is not None else NO_PROMPT
        loads = [ReplicaLoad(r.replica_id, self.num_in_flight.get(r.replica_id, 0)) for r in candidate_replicas]
        decision = self.router.route(routing, loads)
        if forwarded is not None:
            forwarded.decision = decision
        chosen = [r for r in candidate_replicas if r.replica_id == decision.replica_id]
        others = sorted((r for r in candidate_replicas if r.replica_id != decision.replica_id),
                        key=lambda r: self.num_in_flight.get(r.replica_id, 0))
        return [chosen, others]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        forwarded = _forwarded(pending_request)
        self.router.on_routed(forwarded.routing if forwarded is not None else NO_PROMPT, replica_id)
        if forwarded is not None and forwarded.decision is not None and forwarded.decision.replica_id != replica_id:
            forwarded.decision = None  # the chosen replica was full: the request went elsewhere
        self.num_in_flight[replica_id] = self.num_in_flight.get(replica_id, 0) + 1
        self.in_flight[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.in_flight.pop(internal_request_id, None) is not None:
            self.num_in_flight[replica_id] = max(0, self.num_in_flight.get(replica_id, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.router.on_replica_removed(replica_id)
        self.num_in_flight.pop(replica_id, None)


def _forwarded(pending_request: Optional[PendingRequest]) -> Optional[ForwardedRequest]:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, ForwardedRequest) else None
