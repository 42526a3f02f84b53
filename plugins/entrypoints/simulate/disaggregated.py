"""Prefill and decode apart, simulated: P prefill instances and D decode instances sharing a KV store.

Each trace request goes first to a prefill instance (picked by the router among the prefill instances) as a
request of one output token, as ``pagoda kv-proxy`` and ``pagoda serve --replica-roles`` send it: that
instance computes the prompt and, when the request finishes there, its full prompt blocks are in the store.
After the hand-off (``KVHandoff``: a fixed cost per request plus a cost per block loaded), the request goes to
a decode instance, whose real scheduler loads those blocks at admission through :class:`HandedOverBlocks`
(the scheduler's ``kv_transfers`` hook, as a real KV connector's) and computes only the prompt's last
partial block before decoding. The client's first token is the decode instance's, so TTFT counts the
prefill, the hand-off and the decode instance's queue and first step.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass
from typing import Optional, Sequence as Seq

from pagoda.errors import ConfigError
from pagoda.plugins.entrypoints.simulate.simulator import Route, SimulatedEngine, _stuck
from pagoda.plugins.entrypoints.simulate.trace import TraceRequest

# milliseconds a request's hand-off costs besides its blocks: an estimate of one more HTTP exchange through the
# proxy on loopback (the prefill instance's answer, the decode instance's request)
DEFAULT_HANDOFF_MS = 2.0
# milliseconds to load one block of the default model in bf16 (360 KiB) from a shared-disk folder in the page
# cache: read, framing and crc32 checked, copied into a cache tensor on one thread; the median of 7 rounds of 64
# blocks on the 2-core EPYC development machine under a load average of 20 (1.1 to 2.5 ms)
DEFAULT_BLOCK_LOAD_MS = 1.4


@dataclass(frozen=True)
class KVHandoff:
    """What moving a request from a prefill to a decode instance costs: ``fixed_s`` plus ``per_block_s`` for each
    full prompt block the decode instance loads."""

    fixed_s: float = DEFAULT_HANDOFF_MS / 1e3
    per_block_s: float = DEFAULT_BLOCK_LOAD_MS / 1e3

    def seconds(self, num_blocks: int) -> float:
        return self.fixed_s + self.per_block_s * num_blocks


def parse_split(text: str) -> tuple[int, int]:
    """``P:D`` (prefill instances : decode instances), each at least 1."""
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--prefill-decode {text!r}: write P:D, the prefill and decode instances, e.g. 1:1 "
                          "or 1:3") from None
    if p < 1 or d < 1:
        raise ConfigError(f"--prefill-decode {text}: pass at least one prefill and one decode instance")
    return p, d


class HandedOverBlocks:
    """A decode instance's ``Scheduler.kv_transfers``: every full prompt block of a request handed over from a
    prefill instance is in the store, loaded at admission (after the instance's own prefix-cache hits), the
    last token always computed, as :class:`pagoda.kv.connector.KVTransfers` does for a connector in role
    ``decode``. A request preempted and recomputed is not looked up again (as in the engine)."""

    saves_blocks = False

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._asked: set[str] = set()
        self.blocks_loaded = 0

    def blocks_for(self, request, num_cached: int) -> list:
        rid = request.request_id
        if rid in self._asked or request.num_output_tokens:
            return []
        self._asked.add(rid)
        first, end = num_cached // self.block_size, (request.num_tokens - 1) // self.block_size
        return [(0, None)] * max(0, end - first)

    def admitted(self, request, num_loaded: int) -> None:
        self.blocks_loaded += num_loaded

    def note_scheduled(self, out, request, num_computed: int, num_new: int, block_table) -> None:
        pass  # a decode instance saves nothing

    def save(self, sched, saved) -> None:
        pass

    def drop_saves(self, sched) -> None:
        pass

    def forget(self, request) -> None:
        self._asked.discard(request.request_id)


def prefill_trace(trace: Seq[TraceRequest]) -> list[TraceRequest]:
    """The trace as the prefill instances get it: one output token each."""
    return [dataclasses.replace(r, output_len=1) for r in trace]


def run_disaggregated(trace: Seq[TraceRequest], prefill: list[SimulatedEngine], decode: list[SimulatedEngine],
                      route_prefill: Route, route_decode: Route, handoff: KVHandoff, block_size: int) -> None:
    """Replay ``trace`` (sorted by arrival) through prefill instances then decode instances, in lockstep by
    simulated time as :func:`~.simulator.run_trace` does for replicas: the next event first, an arrival (from the
    trace to a prefill instance, or a hand-off to a decode instance) due no later than the earliest busy
    instance's clock before that instance's step. ``prefill``'s engines run :func:`prefill_trace` (their own
    record); ``decode``'s write the run's record, and a request that failed on a prefill instance is recorded
    there as failed with the same error."""
    handed: list[tuple[float, int]] = []  # (time it reaches a decode instance, trace index)
    prefill_record = prefill[0].record
    decode_record = decode[0].record
    for engine in decode:
        engine.scheduler.kv_transfers = HandedOverBlocks(block_size)

    def finished(index: int, clock: float) -> None:
        error = prefill_record.errors.get(index)
        if error is not None:
            decode_record.errors[index] = error
            return
        num_blocks = (trace[index].prompt_len - 1) // block_size
        heapq.heappush(handed, (clock + handoff.seconds(num_blocks), index))

    for engine in prefill:
        engine.on_finish = finished
    engines = prefill + decode
    n, i = len(trace), 0
    while True:
        busy = [e for e in engines if e.has_work()]
        earliest = min(busy, key=lambda e: e.clock) if busy else None
        next_arrival = trace[i].arrival if i < n else math.inf
        next_handoff = handed[0][0] if handed else math.inf
        due_at = min(next_arrival, next_handoff)
        if due_at < math.inf and (earliest is None or due_at <= earliest.clock):
            for e in engines:
                if not e.has_work() and e.clock < due_at:
                    e.clock = due_at
            due = max(due_at, earliest.clock if earliest is not None else due_at)
            while i < n and trace[i].arrival <= due:
                prefill[_checked(route_prefill(i, trace[i], prefill), prefill)].add_request(i, prefill_trace_one(
                    trace[i]))
                if i in prefill_record.errors:  # refused at once (too long, ...): never handed over
                    decode_record.errors[i] = prefill_record.errors[i]
                i += 1
            while handed and handed[0][0] <= due:
                _, index = heapq.heappop(handed)
                decode[_checked(route_decode(index, trace[index], decode), decode)].add_request(index, trace[index])
            continue
        if earliest is None:
            break
        if not earliest.step():
            earliest.clock = due_at if due_at < math.inf else _stuck(earliest)
    for e in engines:
        e.collect_prefix_stats()


def prefill_trace_one(request: TraceRequest) -> TraceRequest:
    return dataclasses.replace(request, output_len=1)


def _checked(target: int, engines: list) -> int:
    if not 0 <= target < len(engines):
        raise ConfigError(f"route returned instance {target}; there are {len(engines)}")
    return target


def slo_goodput(ttft, tpot, num_requests: int, duration: float, ttft_slo: float, tpot_slo: float) -> dict:
    """Goodput under a TTFT and a TPOT target (seconds): the completed requests (``ttft``, ``tpot``: numpy arrays
    over them, a TPOT of NaN for one output token: its TTFT decides) that met both, per second of the run, and
    their share of all ``num_requests`` (a failed request meets neither)."""
    import numpy as np

    met = int(((ttft <= ttft_slo) & (np.isnan(tpot) | (tpot <= tpot_slo))).sum())
    return {"ttft_slo_ms": ttft_slo * 1e3, "tpot_slo_ms": tpot_slo * 1e3, "met": met,
            "attainment": met / num_requests if num_requests else math.nan,
            "goodput_rps": met / max(duration, 1e-9)}
