"""Request routers: which engine replica serves a request.

A router sees each request as the chained hashes of its prompt's full blocks (the same hashes the
prefix cache keys its blocks by, :func:`pagoda.kv.blocks.hash_block`) and each replica as its load. It
is plain bookkeeping over ids and counts, so the same router runs behind ``pagoda serve --replicas``
(inside Ray Serve's request router) and in a simulator.

Built-ins (``pagoda_routers``):

- ``prefix-aware``: a request for a LoRA adapter goes to a replica the adapter was routed to before (so
  likely still loaded there) when one is; among those (or all replicas), to the one whose recorded
  prompts share the longest prefix with it, ties and misses to the least loaded; when loads differ by
  more than ``imbalance_threshold`` requests it goes to the least loaded replica regardless of both.
- ``power-of-two``: the less loaded of two replicas drawn at random.
- ``least-loaded``: the least loaded replica.
"""

from __future__ import annotations

import random
import typing
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Optional

from pagoda import hookimpl
from pagoda.kv.blocks import hash_block

DEFAULT_IMBALANCE_THRESHOLD = 8
# block hashes remembered per replica: 64k blocks of 16 tokens is a million prompt tokens
DEFAULT_MAX_HASHES_PER_REPLICA = 1 << 16
# LoRA adapters remembered per replica: the engine's default --max-cpu-loras is --max-loras, often 1 to 8
DEFAULT_MAX_LORAS_PER_REPLICA = 8


def prompt_block_hashes(token_ids: typing.Sequence[int], block_size: int,
                        lora_name: Optional[str] = None) -> list[int]:
    """Chained hashes of the prompt's full blocks: hash ``i`` stands for tokens ``0 .. (i+1)*block_size``. A
    LoRA adapter's prompts hash apart from the base model's and other adapters' (as the prefix cache keys them)."""
    extra_keys = () if lora_name is None else ("lora", lora_name)
    hashes: list[int] = []
    parent: Optional[int] = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class RoutingRequest:
    """What a router knows of a request: its prompt's block hashes and length, and the LoRA adapter it names
    (None: the base model)."""

    request_id: str
    block_hashes: tuple[int, ...]
    num_prompt_tokens: int
    lora_name: Optional[str] = None


@dataclass(frozen=True)
class ReplicaLoad:
    """One candidate replica: ``num_requests`` is what it is serving or has queued."""

    replica_id: Hashable
    num_requests: int


@dataclass(frozen=True)
class RoutingDecision:
    """The chosen replica, the prompt blocks it is believed to hold, and why it was chosen
    (``prefix``, ``lora`` (a replica the request's adapter was routed to), ``least_loaded`` or ``imbalance``)."""

    replica_id: Hashable
    num_matched_blocks: int
    reason: str


class LeastLoadedRouter:
    """The least loaded replica; ties go to the replica that was chosen least often."""

    def __init__(self, seed: Optional[int] = None) -> None:
        self.rng = random.Random(seed)
        self.num_routed: dict[Hashable, int] = {}

    def route(self, request: RoutingRequest, replicas: typing.Sequence[ReplicaLoad]) -> RoutingDecision:
        if not replicas:
            raise ValueError("no replica to route to: the replica list is empty")
        return RoutingDecision(self._least_loaded(replicas), 0, "least_loaded")

    def _least_loaded(self, replicas: typing.Sequence[ReplicaLoad]) -> Hashable:
        fewest = min(r.num_requests for r in replicas)
        tied = [r.replica_id for r in replicas if r.num_requests == fewest]
        least_used = min(self.num_routed.get(r, 0) for r in tied)
        return self.rng.choice([r for r in tied if self.num_routed.get(r, 0) == least_used])

    def on_routed(self, request: RoutingRequest, replica_id: Hashable) -> None:
        """Record that ``request`` went to ``replica_id`` (whoever decided it)."""
        self.num_routed[replica_id] = self.num_routed.get(replica_id, 0) + 1

    def on_replica_removed(self, replica_id: Hashable) -> None:
        """Forget a replica that stopped."""
        self.num_routed.pop(replica_id, None)


class PowerOfTwoRouter(LeastLoadedRouter):
    """The less loaded of two replicas drawn at random (the usual load balancer of serving systems);
    a tie goes to the first drawn."""

    def route(self, request: RoutingRequest, replicas: typing.Sequence[ReplicaLoad]) -> RoutingDecision:
        if not replicas:
            raise ValueError("no replica to route to: the replica list is empty")
        pair = self.rng.sample(list(replicas), min(2, len(replicas)))
        return RoutingDecision(min(pair, key=lambda r: r.num_requests).replica_id, 0, "least_loaded")


class PrefixAwareRouter(LeastLoadedRouter):
    """A replica with the request's LoRA adapter, then the longest recorded prefix, least loaded on a miss or
    when loads are imbalanced.

    Each replica's record is an LRU set of the block hashes of the prompts routed to it, at most
    ``max_hashes_per_replica`` of them: an approximation of its prefix cache that needs nothing
    from the replica. A prefix counts only from ``min_match_blocks`` blocks on. Likewise each replica's
    adapters are the names of the last ``max_loras_per_replica`` adapters routed to it (set it to the
    replicas' ``--max-cpu-loras``: the adapters a replica keeps loaded).
    """

    def __init__(self, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD, min_match_blocks: int = 1,
                 max_hashes_per_replica: int = DEFAULT_MAX_HASHES_PER_REPLICA,
                 max_loras_per_replica: int = DEFAULT_MAX_LORAS_PER_REPLICA, seed: Optional[int] = None) -> None:
        if imbalance_threshold < 0 or min_match_blocks < 1 or max_hashes_per_replica < 1 or max_loras_per_replica < 1:
            raise ValueError(f"prefix-aware router: imbalance_threshold must be >= 0 (got {imbalance_threshold}), "
                             f"min_match_blocks >= 1 (got {min_match_blocks}), max_hashes_per_replica >= 1 "
                             f"(got {max_hashes_per_replica}), max_loras_per_replica >= 1 "
                             f"(got {max_loras_per_replica})")
        super().__init__(seed)
        self.imbalance_threshold = imbalance_threshold
        self.min_match_blocks = min_match_blocks
        self.max_hashes_per_replica = max_hashes_per_replica
        self.max_loras_per_replica = max_loras_per_replica
        self.records: dict[Hashable, OrderedDict[int, None]] = {}
        self.lora_records: dict[Hashable, OrderedDict[str, None]] = {}  # replica -> adapter names, oldest first

    def has_lora(self, replica_id: Hashable, lora_name: str) -> bool:
        """Whether ``lora_name`` is among the adapters last routed to ``replica_id`` (so likely loaded there)."""
        return lora_name in self.lora_records.get(replica_id, ())

    def num_matched_blocks(self, request: RoutingRequest, replica_id: Hashable) -> int:
        """Leading blocks of the request's prompt recorded for ``replica_id``."""
        record = self.records.get(replica_id)
        if not record:
            return 0
        matched = 0
        for h in request.block_hashes:
            if h not in record:
                break
            matched += 1
        return matched

    def route(self, request: RoutingRequest, replicas: typing.Sequence[ReplicaLoad]) -> RoutingDecision:
        if not replicas:
            raise ValueError("no replica to route to: the replica list is empty")
        loads = [r.num_requests for r in replicas]
        if max(loads) - min(loads) > self.imbalance_threshold:
            return RoutingDecision(self._least_loaded(replicas), 0, "imbalance")
        miss = "least_loaded"
        if request.lora_name is not None:  # only the replicas that have the adapter, when any has it
            with_lora = [r for r in replicas if self.has_lora(r.replica_id, request.lora_name)]
            if with_lora:
                replicas, miss = with_lora, "lora"
        matches = {r.replica_id: self.num_matched_blocks(request, r.replica_id) for r in replicas}
        best = max(matches.values())
        if best < self.min_match_blocks:
            return RoutingDecision(self._least_loaded(replicas), 0, miss)
        holders = [r for r in replicas if matches[r.replica_id] == best]
        return RoutingDecision(self._least_loaded(holders), best, "prefix")

    def on_routed(self, request: RoutingRequest, replica_id: Hashable) -> None:
        super().on_routed(request, replica_id)
        if request.lora_name is not None:
            loras = self.lora_records.setdefault(replica_id, OrderedDict())
            loras[request.lora_name] = None
            loras.move_to_end(request.lora_name)
            while len(loras) > self.max_loras_per_replica:
                loras.popitem(last=False)
        record = self.records.setdefault(replica_id, OrderedDict())
        # the first block is touched last: LRU eviction then drops a prompt's tail before its head,
        # so a recorded prefix stays a prefix
        for h in reversed(request.block_hashes):
            record[h] = None
            record.move_to_end(h)
        while len(record) > self.max_hashes_per_replica:
            record.popitem(last=False)

    def on_replica_removed(self, replica_id: Hashable) -> None:
        super().on_replica_removed(replica_id)
        self.records.pop(replica_id, None)
        self.lora_records.pop(replica_id, None)


def make_router(name: str, options: Optional[dict[str, Any]], plugin_manager: Any) -> Any:
    """The router ``name`` (a ``pagoda_routers`` component) built with ``options``."""
    factory = plugin_manager.get("pagoda_routers", name, "router").factory
    try:
        return factory(**(options or {}))
    except TypeError as exc:
        raise ValueError(f"router {name!r} does not take the options {sorted(options or {})}: {exc}") from None


@hookimpl
def pagoda_routers():
    return {"prefix-aware": PrefixAwareRouter, "power-of-two": PowerOfTwoRouter, "least-loaded": LeastLoadedRouter}
