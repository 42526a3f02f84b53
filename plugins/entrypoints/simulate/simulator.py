"""A simulated engine: the real scheduler and KV allocator plugins, a cost model instead of a model.

Each step runs the scheduler plugin's ``schedule`` and ``update`` exactly as the engine does; the
"execution" samples one placeholder token for every sequence that reached the end of its known
tokens, and the simulated clock advances by the cost model's seconds for that schedule. A
:class:`SimulatedEngine` is one replica; :func:`run_trace` advances any number of them in lockstep
by simulated time, handing each arrival to the replica ``route(request, engines)`` picks.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from typing import Callable, Optional, Sequence as Seq

from pagoda.config import EngineConfig
from pagoda.engine.request_limits import RequestLimits
from pagoda.errors import ConfigError, InvalidRequestError
from pagoda.execution.lora_request import LoRARequest
from pagoda.plugins.entrypoints.simulate.cost_model import CostModel, PipelineHandoff
from pagoda.plugins.entrypoints.simulate.lora import AdapterResidency, LoRACosts
from pagoda.plugins.entrypoints.simulate.trace import PromptMaker, TraceRequest
from pagoda.sampling_params import SamplingParams
from pagoda.sequence import Sequence
from pagoda.step import RunnerOutput

# the token every simulated sample produces: no stop condition looks at it (ignore_eos, no stop ids)
SIM_TOKEN = 100
# one step's sample, shared by every sequence that samples (the scheduler only reads it)
_ONE_SAMPLE = (SIM_TOKEN,)


class RunRecord:
    """What one run (simulated or real) measured: per request and per step, in seconds from the trace's start."""

    def __init__(self, trace: Seq[TraceRequest]) -> None:
        n = len(trace)
        self.arrival = array("d", (r.arrival for r in trace))
        self.prompt_len = array("q", (r.prompt_len for r in trace))
        self.priority = array("q", (r.priority for r in trace))
        self.tenant = [r.tenant for r in trace]
        self.lora_name = [r.lora_name for r in trace]
        self.first_scheduled = array("d", [math.nan]) * n
        self.first_token = array("d", [math.nan]) * n
        self.last_token = array("d", [math.nan]) * n
        self.finish = array("d", [math.nan]) * n
        self.num_output = array("q", [0]) * n
        self.itl = array("d")  # every gap between two tokens of one request
        self.errors: dict[int, str] = {}
        # per step: the time it ended, its seconds and the fraction of KV blocks held by requests after it
        self.step_end = array("d")
        self.step_seconds = array("d")
        self.kv_usage = array("d")
        self.num_preemptions = 0
        self.num_swapped_out = 0  # preemptions that swapped a request's blocks out
        self.num_blocks_swapped = 0  # blocks moved out plus blocks moved in
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.handoff_seconds = 0.0  # pipeline stages' hand-offs, summed over the steps
        self.num_lora_loads = 0  # adapters read from disk
        self.num_lora_slot_loads = 0  # adapters copied into a slot
        self.lora_load_seconds = 0.0  # the step time both took


class SimulatedEngine:
    """One simulated replica: a scheduler plugin over a KV allocator plugin, timed by a cost model."""

    def __init__(self, scheduler, kv_manager, cost_model: CostModel, limits: RequestLimits, record: RunRecord,
                 prompts: PromptMaker, handoff: Optional[PipelineHandoff] = None,
                 adapters: Optional[AdapterResidency] = None) -> None:
        self.scheduler = scheduler
        self.handoff = handoff  # pipeline parallelism's hand-offs between stages (None: one stage)
        self.kv = kv_manager
        self.cost_model = cost_model
        self.limits = limits  # what the real engine checks each request against
        self.record = record
        self.prompts = prompts
        self.clock = 0.0
        self.num_steps = 0
        self._index: dict[str, int] = {}  # request id -> trace index, while the request runs here
        self._params: dict[int, SamplingParams] = {}  # one SamplingParams per output length
        self.adapters = adapters  # None: LoRA off
        self._loras: dict[str, LoRARequest] = {}  # adapter name -> the request naming it (ids 1, 2, ...)
        # called with (trace index, clock) as each request ends here (a prefill instance hands it over)
        self.on_finish: Optional[Callable[[int, float], None]] = None

    @property
    def num_unfinished(self) -> int:
        return len(self._index)

    def has_work(self) -> bool:
        return bool(self._index)

    def add_request(self, index: int, req: TraceRequest) -> None:
        """Queue trace request ``index``; one the engine would refuse is recorded as failed, with its message."""
        params = self._params.get(req.output_len)
        if params is None:
            params = self._params[req.output_len] = SamplingParams(max_tokens=req.output_len, ignore_eos=True)
        token_ids = self.prompts.tokens(index, req)
        try:
            self.limits.check(token_ids, params)
        except InvalidRequestError as exc:
            self.record.errors[index] = str(exc)
            return
        rid = str(index)
        lora = None
        if req.lora_name is not None:  # the path is never read: the simulator loads no weights
            lora = self._loras.setdefault(req.lora_name, LoRARequest(req.lora_name, len(self._loras) + 1, "simulated"))
        seq = Sequence(rid, token_ids, params, None, req.arrival, None, req.priority, parent_id=rid,
                       tenant=req.tenant, lora_request=lora)
        self._index[rid] = index
        self.scheduler.add_request(seq)

    def step(self) -> bool:
        """Run one step at the current clock; False (the clock unmoved) if the scheduler had nothing to run."""
        sched = self.scheduler.schedule()
        requests = sched.requests
        rec = self.record
        if sched.preempted:
            rec.num_preemptions += len(sched.preempted)
            rec.num_swapped_out += sum(1 for r in sched.preempted if self.kv.is_swapped(r.request_id))
        num_moved = len(sched.blocks_to_swap_out) + len(sched.blocks_to_swap_in)
        rec.num_blocks_swapped += num_moved
        if not requests:
            if sched.failed or sched.preempted:  # commit them: nothing ran, but they were decided
                self.scheduler.update(sched, RunnerOutput.empty(0))
            self._drain_finished()
            return False
        seconds = self.cost_model.step_seconds(sched.num_new_tokens, sched.num_computed_before, num_moved)
        if self.adapters is not None:
            seconds += self._lora_seconds(requests, seconds)
        if self.handoff is not None:
            handoff = self.handoff.seconds(sum(sched.num_new_tokens))
            rec.handoff_seconds += handoff
            seconds += handoff
        start_time = self.clock
        first_scheduled = rec.first_scheduled
        index = self._index
        num_new_tokens = sched.num_new_tokens
        # a sample for every sequence that reached the end of its known tokens (len(all_token_ids): num_tokens)
        sampled = [_ONE_SAMPLE if start + n >= len(req.all_token_ids) else ()
                   for req, n, start in zip(requests, num_new_tokens, sched.num_computed_before)]
        for req, n in zip(requests, num_new_tokens):
            if n > 1:  # a prefill chunk: maybe the request's first step (a one-token first chunk: see below)
                i = index.get(req.request_id)
                if i is not None and first_scheduled[i] != first_scheduled[i]:  # NaN: not scheduled before
                    first_scheduled[i] = start_time
        num = len(requests)
        progressed = self.scheduler.update(
            sched, RunnerOutput(sampled, [None] * num, [None] * num, [0] * num, execute_seconds=seconds))
        self.clock = now = start_time + seconds
        self.num_steps += 1
        first_token, last_token, itl = rec.first_token, rec.last_token, rec.itl
        for req in progressed:
            i = index[req.request_id]
            last = last_token[i]
            if last != last:
                first_token[i] = now
                if first_scheduled[i] != first_scheduled[i]:
                    first_scheduled[i] = start_time  # its whole prompt but one token was cached
            else:
                itl.append(now - last)
            last_token[i] = now
        self._drain_finished()
        rec.step_end.append(now)
        rec.step_seconds.append(seconds)
        rec.kv_usage.append(self.kv.usage)
        return True

    def _lora_seconds(self, requests, step_seconds: float) -> float:
        """What a step's adapters add: loading those not in a slot, and the LoRA terms' share of the step."""
        names = list(dict.fromkeys(r.lora_request.lora_name for r in requests if r.lora_request is not None))
        if not names:
            return 0.0
        adapters, rec = self.adapters, self.record
        loads, slot_loads = adapters.num_loads, adapters.num_slot_loads
        load_seconds = adapters.step_seconds(names)
        rec.num_lora_loads += adapters.num_loads - loads
        rec.num_lora_slot_loads += adapters.num_slot_loads - slot_loads
        rec.lora_load_seconds += load_seconds
        return load_seconds + step_seconds * adapters.costs.step_overhead

    def _drain_finished(self) -> None:
        rec = self.record
        for req in self.scheduler.drain_finished():
            i = self._index.pop(req.request_id, None)
            if i is None:
                continue
            rec.finish[i] = self.clock
            rec.num_output[i] = req.num_output_tokens
            if req.error:
                rec.errors[i] = req.error
            if self.on_finish is not None:
                self.on_finish(i, self.clock)

    def collect_prefix_stats(self) -> None:
        stats = self.kv.stats
        self.record.prefix_queries += stats.queries
        self.record.prefix_hits += stats.hits


# (trace index, request, replicas) -> the index of the replica that gets it
Route = Callable[[int, TraceRequest, list[SimulatedEngine]], int]


def run_trace(trace: Seq[TraceRequest], engines: list[SimulatedEngine], route: Optional[Route] = None) -> None:
    """Replay ``trace`` (sorted by arrival) through ``engines`` in lockstep by simulated time.

    Next event first: an arrival that is due no later than the earliest busy replica's clock is routed
    (idle replicas wait at that time); otherwise the busy replica furthest behind runs one step. So each
    routing decision sees every replica as it is at the request's arrival, to within one step.
    """
    if route is None:
        if len(engines) != 1:
            raise ConfigError(f"{len(engines)} replicas need a route(index, request, replicas) -> replica index")
        route = _only_one
    n, i = len(trace), 0
    while True:
        busy = [e for e in engines if e.has_work()]
        earliest = min(busy, key=lambda e: e.clock) if busy else None
        if i < n and (earliest is None or trace[i].arrival <= earliest.clock):
            arrival = trace[i].arrival
            for e in engines:
                if not e.has_work() and e.clock < arrival:
                    e.clock = arrival
            # every request already due joins at once: the engine adds arrivals between steps
            due = max(arrival, earliest.clock if earliest is not None else arrival)
            while i < n and trace[i].arrival <= due:
                target = route(i, trace[i], engines)
                if not 0 <= target < len(engines):
                    raise ConfigError(f"route returned replica {target}; there are {len(engines)}")
                engines[target].add_request(i, trace[i])
                i += 1
            continue
        if earliest is None:
            break
        if not earliest.step():
            # nothing could run (every request waits on something that cannot progress): let time pass
            earliest.clock = trace[i].arrival if i < n else _stuck(earliest)
    for e in engines:
        e.collect_prefix_stats()


def _only_one(index: int, request: TraceRequest, engines: list[SimulatedEngine]) -> int:
    return 0


def _stuck(engine: SimulatedEngine) -> float:
    raise RuntimeError(f"the scheduler {type(engine.scheduler).__name__} scheduled nothing with "
                       f"{engine.num_unfinished} requests unfinished and none arriving; they can never finish")


def least_loaded(index: int, request: TraceRequest, engines: list[SimulatedEngine]) -> int:
    """The replica with the fewest unfinished requests (ties: the lowest index)."""
    return min(range(len(engines)), key=lambda k: engines[k].num_unfinished)


def router_route(router, block_size: int) -> Route:
    """A ``pagoda_routers`` router (what ``pagoda serve --replicas`` routes with) as a simulator route: it sees
    the prompt's chained block hashes and each replica's unfinished requests, as behind the server."""
    from pagoda.execution.routing import ReplicaLoad, RoutingRequest, prompt_block_hashes

    def route(index: int, request: TraceRequest, engines: list[SimulatedEngine]) -> int:
        tokens = engines[0].prompts.tokens(index, request)
        hashes = prompt_block_hashes(tokens, block_size, request.lora_name)
        routing_request = RoutingRequest(str(index), tuple(hashes), len(tokens), request.lora_name)
        decision = router.route(routing_request, [ReplicaLoad(k, e.num_unfinished) for k, e in enumerate(engines)])
        router.on_routed(routing_request, decision.replica_id)
        return decision.replica_id

    return route


def build_engines(config: EngineConfig, pm, cost_model: CostModel, trace: Seq[TraceRequest],
                  num_replicas: int = 1, seed: int = 0, handoff: Optional[PipelineHandoff] = None,
                  lora_costs: Optional[LoRACosts] = None) -> tuple[list[SimulatedEngine], RunRecord]:
    """``num_replicas`` simulated engines with the configured scheduler and KV allocator plugins, sized as the
    real engine would size its KV cache from ``config`` (per pipeline stage with several); one record they all
    write to. ``handoff``: the stages' hand-offs each step adds. A trace naming LoRA adapters needs LoRA on in
    ``config`` (its ``max_loras`` and ``max_cpu_loras`` bound each replica's)."""
    from pagoda.registry.adapt import adapt_component
    from pagoda.scheduling import build_scheduler

    mc, cc = config.model, config.cache
    allocator = pm.get("pagoda_kv_allocators", cc.kv_allocator, "kv_allocator").factory
    if config.speculative is not None:
        raise ConfigError("the simulator has no cost model for speculative decoding; drop --speculative-config")
    if config.lora is None and any(r.lora_name is not None for r in trace):
        raise ConfigError("the trace names LoRA adapters; pass --enable-lora (and --max-loras N, --max-cpu-loras M "
                          "as the served engine has them) to simulate them")
    num_blocks, num_swap_blocks = kv_cache_blocks(config)
    record = RunRecord(trace)
    prompts = PromptMaker(mc.vocab_size, seed)
    engines = []
    for _ in range(num_replicas):
        kv = adapt_component(allocator(cc, num_blocks), "pagoda_kv_allocators", cc.kv_allocator)
        scheduler = build_scheduler(pm, config.scheduler, cc, kv, config.lora)
        if cc.preemption_mode == "swap":
            kv.init_swap_pool(num_swap_blocks)
        limits = RequestLimits(mc.max_model_len, mc.vocab_size, num_blocks, kv.blocks_needed)
        adapters = AdapterResidency(config.lora, lora_costs or LoRACosts()) if config.lora is not None else None
        engines.append(SimulatedEngine(scheduler, kv, cost_model, limits, record, prompts, handoff, adapters))
    return engines, record


def kv_cache_blocks(config: EngineConfig) -> tuple[int, int]:
    """KV blocks and swap blocks the real engine would have: its memory over one block's K and V in every layer
    (every layer of the largest pipeline stage: each stage keeps its own layers' K/V in that memory)."""
    import torch

    from pagoda.config import resolve_kv_cache_dtype

    mc, cc = config.model, config.cache
    element = torch.empty(0, dtype=resolve_kv_cache_dtype(cc.kv_cache_dtype, mc.dtype)).element_size()
    num_layers = max(config.parallel.pipeline_layer_partition or (mc.num_layers,))
    bytes_per_block = 2 * cc.block_size * mc.num_kv_heads * mc.head_dim * element * num_layers
    num_blocks = cc.num_gpu_blocks_override or cc.kv_cache_memory_bytes // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(f"kv_cache_memory_bytes={cc.kv_cache_memory_bytes} holds no KV block ({bytes_per_block} "
                          "bytes each); raise it")
    return num_blocks, cc.swap_space_bytes // bytes_per_block


def with_policy(config: EngineConfig, policy: str) -> EngineConfig:
    """The same configuration under another scheduling policy (for side-by-side runs); the options given belong
    to the configured policy, so another one runs with its defaults."""
    if policy == config.scheduler.policy:
        return config
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, policy=policy,
                                                                     policy_options={}))
