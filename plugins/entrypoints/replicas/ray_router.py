"""Ray Serve's request router for engine replicas, deciding through a pagoda router component.

Ray Serve builds one in every process that holds a handle to the engine deployment (the ingress);
it sees each request's :class:`~.forward.ForwardedRequest` before the request is sent. Loads are the
requests this router has in flight on each replica. The router's choice is tried first, then the
other replicas from the least loaded, so a full replica does not hold a request back.
"""

from __future__ import annotations

from typing import Any, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from pagoda.execution.routing import ReplicaLoad, make_router
from pagoda.plugins.entrypoints.replicas.forward import NO_PROMPT, ForwardedRequest
from pagoda.registry.plugin_manager import get_plugin_manager


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
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        if request_id is not None and request_id not in self.in_flight:
            # counted at once, so the requests routed before this one is sent see its load and its prefix
            self.router.on_routed(routing, decision.replica_id)
            self._count(request_id, decision.replica_id)
        chosen = [r for r in candidate_replicas if r.replica_id == decision.replica_id]
        others = sorted((r for r in candidate_replicas if r.replica_id != decision.replica_id),
                        key=lambda r: self.num_in_flight.get(r.replica_id, 0))
        return [chosen, others]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        request_id = pending_request.metadata.internal_request_id
        decided = self.in_flight.get(request_id)
        if decided == replica_id:
            return
        forwarded = _forwarded(pending_request)
        if forwarded is not None:
            forwarded.decision = None  # the chosen replica was full: the request went elsewhere
        if decided is not None:
            self._uncount(request_id)
        self._count(request_id, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._uncount(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.router.on_replica_removed(replica_id)
        self.num_in_flight.pop(replica_id, None)

    def _count(self, request_id: str, replica_id: ReplicaID) -> None:
        self.in_flight[request_id] = replica_id
        self.num_in_flight[replica_id] = self.num_in_flight.get(replica_id, 0) + 1

    def _uncount(self, request_id: str) -> None:
        replica_id = self.in_flight.pop(request_id, None)
        if replica_id is not None and replica_id in self.num_in_flight:
            self.num_in_flight[replica_id] = max(0, self.num_in_flight[replica_id] - 1)


def _forwarded(pending_request: Optional[PendingRequest]) -> Optional[ForwardedRequest]:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, ForwardedRequest) else None
