"""Engine statistics and their Prometheus exporter.

``EngineStats`` is written by the engine thread only: plain counters and
fixed-bucket histograms, no locks, no tensors. ``PrometheusExporter`` reads it
(and the scheduler's and KV manager's live gauges) when ``/metrics`` is
scraped. Names are vLLM's with the ``pagoda:`` prefix, buckets are vLLM's, so
existing dashboards and alerts port by a prefix rename.
"""

from __future__ import annotations

import typing
import bisect
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from pagoda.interfaces import has_window_slots
from pagoda.kv.tiers import has_offload_tiers
from pagoda.sequence import Sequence

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# the reasons request_success is always exported with, so rate() works from the first scrape
FINISH_REASONS = ("stop", "length", "abort", "error")


class Histogram:
    """Fixed upper bounds plus +Inf; ``counts[i]`` holds observations in bucket i (not cumulative)."""

    def __init__(self, bounds: typing.Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, cumulative count), ...]`` ending with ``+Inf``, as the exposition format wants."""
        total, result = 0, []
        for bound, n in zip(self.bounds + (float("inf"),), list(self.counts)):
            total += n
            result.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return result


@dataclass
class SpecDecodeStats:
    """Speculative decoding's acceptance counters (vLLM's ``spec_decode_*`` metrics), written by the engine thread."""

    num_speculative_tokens: int
    num_drafts: int = 0  # verify runs: one per request per step that carried at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [k]: how often the draft at position j (0-based) was accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify run: accepted drafts plus the corrected or bonus token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class EngineStats:
    """Counters and latency histograms, updated by the engine as requests arrive, step and finish."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_requests_arrived: int = 0
    finished_by_reason: Counter = field(default_factory=Counter)
    num_steps: int = 0
    step_seconds: float = 0.0  # wall time of the steps counted by num_steps: schedule, execute, update, emit
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    request_queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    # request id -> time its previous token was produced (monotonic seconds), while it runs
    _last_token_time: dict[str, float] = field(default_factory=dict, repr=False)

    def on_arrival(self, num_prompt_tokens: int) -> None:
        self.num_requests_arrived += 1
        self.num_prompt_tokens += num_prompt_tokens

    def on_step(self, sched, progressed: list[Sequence], now: float, num_new_tokens: Optional[int] = None) -> None:
        """``progressed``: the requests that gained tokens at ``now`` (``num_new_tokens`` in all; one each
        when not given)."""
        self.num_steps += 1
        self.num_generation_tokens += len(progressed) if num_new_tokens is None else num_new_tokens
        last = self._last_token_time
        for req in progressed:
            prev = last.get(req.request_id)
            if prev is None:
                self.time_to_first_token.observe(now - req.arrival_time)
            else:
                self.inter_token_latency.observe(now - prev)
            last[req.request_id] = now

    def on_step_time(self, seconds: float) -> None:
        """A step that ran the model (one counted by ``num_steps``) took ``seconds``."""
        self.step_seconds += seconds

    def on_finished(self, request: Sequence, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        self.finished_by_reason[request.finish_reason] += 1
        self._last_token_time.pop(request.request_id, None)
        self.e2e_request_latency.observe(now - request.arrival_time)
        if request.scheduled_time is not None:
            self.request_queue_time.observe(request.scheduled_time - request.arrival_time)


@dataclass
class ServingStats:
    """Where a served request's outputs spend time off the engine thread, in seconds, written on the event loop
    only: turning each step's tokens into text and decoded logprobs (``detokenize``), building the
    ``RequestOutput`` (``output``), and making the response's chunks and their JSON (``encode``, streamed
    responses)."""

    detokenize_seconds: float = 0.0
    output_seconds: float = 0.0
    encode_seconds: float = 0.0


class PrometheusExporter:
    """A prometheus_client collector over one engine, in its own registry (no global state).

    ``scheduler`` needs ``num_running``, ``num_waiting``, ``num_preemptions``;
    ``kv_manager`` needs ``usage`` and optionally ``stats.queries`` / ``stats.hits``.
    """

    def __init__(self, stats: Optional[EngineStats], scheduler: Any, kv_manager: Any, model_name: str,
                 spec_stats: Any = None, serving_stats: Optional[ServingStats] = None,
                 lora_info: Optional[Callable[[], tuple[list[str], list[str]]]] = None, max_loras: int = 0,
                 kv_connector_stats: Any = None) -> None:
        from prometheus_client import CollectorRegistry

        self.stats = stats  # None with disable_log_stats: the live gauges and the KV counters only
        self.spec_stats = spec_stats  # SpecDecodeStats when speculative decoding is on
        self.serving_stats = serving_stats  # a served engine's output side (AsyncLLMEngine.serving_stats)
        self.scheduler = scheduler
        self.kv_manager = kv_manager
        self.model_name = model_name
        # LoRA: () -> (running adapters, waiting adapters), and --max-loras; None when LoRA is off
        self.lora_info, self.max_loras = lora_info, max_loras
        self.kv_connector_stats = kv_connector_stats  # a KV connector's KVConnectorStats, None when off
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    @classmethod
    def for_engine(cls, engine: Any, serving_stats: Optional[ServingStats] = None) -> "PrometheusExporter":
        lora = engine.config.lora
        return cls(engine.stats, engine.scheduler, engine.kv_manager, engine.config.model.served_model_name,
                   engine.spec_stats, serving_stats, engine.lora_requests_info if lora is not None else None,
                   lora.max_loras if lora is not None else 0,
                   getattr(getattr(engine, "kv_transfers", None), "stats", None))

    def render(self) -> bytes:
        """The text exposition format, as served at ``/metrics``."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        labels = ["model_name"]
        values = [self.model_name]
        s, sched, kv = self.stats, self.scheduler, self.kv_manager

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(f"pagoda:{name}", doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(f"pagoda:{name}", doc, labels=labels)
            c.add_metric(values, value)
            return c

        def histogram(name: str, doc: str, h: Histogram):
            buckets = h.cumulative()
            f = HistogramMetricFamily(f"pagoda:{name}", doc, labels=labels)
            # the +Inf bucket is the count, so the two always agree even while the engine writes
            f.add_metric(values, buckets, h.sum)
            return f

        yield gauge("num_requests_running", "Requests in the running batch.", sched.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", sched.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", kv.usage)
        if has_window_slots(kv) and kv.window is not None:
            yield gauge("kv_window_pool_usage_perc", "Fraction of the sliding-window layers' KV slots in use "
                        "(--kv-window-pool; 1 = full).", kv.window_usage)
        prefix = kv.stats
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", prefix.queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", prefix.hits)
        yield from _kv_offload_metrics(kv.tiers if has_offload_tiers(kv) else None, labels, values)
        if self.kv_connector_stats is not None:  # pagoda:kv_connector_*: a KV connector's loads and saves
            for name, doc in KV_CONNECTOR_COUNTERS:
                yield counter(f"kv_connector_{name}", doc, getattr(self.kv_connector_stats, name))
        yield counter("num_preemptions", "Preemptions of running requests.", sched.num_preemptions)
        if self.lora_info is not None:
            running, waiting = self.lora_info()
            info = GaugeMetricFamily("pagoda:lora_requests_info", "The LoRA adapters of the running and the waiting "
                                     "requests (comma-separated names); the value is when this was read (Unix time).",
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            info.add_metric([str(self.max_loras), ",".join(waiting), ",".join(running)], time.time())
            yield info
        spec = self.spec_stats
        if spec is not None:
            yield counter("spec_decode_num_drafts", "Verify runs: requests x steps that carried draft tokens.",
                          spec.num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)
            per_pos = CounterMetricFamily("pagoda:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the draft run.",
                                          labels=labels + ["position"])
            for pos, n in enumerate(list(spec.num_accepted_tokens_per_pos)):
                per_pos.add_metric(values + [str(pos)], n)
            yield per_pos
        if s is None:
            return
        yield counter("prompt_tokens", "Prompt tokens received.", s.num_prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.num_generation_tokens)
        yield counter("engine_steps", "Engine steps that ran the model.", s.num_steps)
        yield counter("engine_step_seconds", "Wall time of those steps (schedule, execute, update, emit), the "
                      "engine loop's own time without output processing.", s.step_seconds)
        yield request_success(labels, values, s.finished_by_reason)
        serving = self.serving_stats
        if serving is not None:
            yield counter("serving_detokenize_seconds", "Event-loop time turning generated tokens into text and "
                          "decoded logprobs.", serving.detokenize_seconds)
            yield counter("serving_output_seconds", "Event-loop time building request outputs from them.",
                          serving.output_seconds)
            yield counter("serving_encode_seconds", "Event-loop time making streamed response chunks and their "
                          "JSON.", serving.encode_seconds)
        yield histogram("time_to_first_token_seconds", "Time from arrival to the first token.",
                        s.time_to_first_token)
        yield histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                        s.inter_token_latency)
        yield histogram("e2e_request_latency_seconds", "Time from arrival to finish.", s.e2e_request_latency)
        yield histogram("request_queue_time_seconds", "Time from arrival to first being scheduled.",
                        s.request_queue_time)


KV_CONNECTOR_COUNTERS = (
    ("lookups", "Requests whose prompt blocks the KV connector's store held some of."),
    ("blocks_found", "Prompt blocks the store said it held."),
    ("blocks_loaded", "Prompt blocks loaded from the store instead of computed."),
    ("blocks_failed", "Blocks found but missing, unreadable or failing their checksum when read: computed."),
    ("blocks_saved", "Prompt blocks written to the store."),
    ("save_errors", "Blocks the store refused to save."),
    ("bytes_loaded", "Bytes of KV loaded from the store."),
    ("bytes_saved", "Bytes of KV written to the store."),
)


def _kv_offload_metrics(tiers: Any, labels: list[str], values: list[str]) -> Iterator[Any]:
    """``pagoda:kv_offload_*{tier="ram"|"disk"}``: the prefix cache's offload tiers, when on."""
    if tiers is None:
        return
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    counters = (("hits", "Prefix blocks loaded back from the tier instead of recomputed."),
                ("misses", "Prompts whose next prefix block the tier did not have (or had corrupt)."),
                ("stored_bytes", "Bytes of KV blocks written into the tier (one rank's shard)."),
                ("loaded_bytes", "Bytes of KV blocks loaded back from the tier (one rank's shard)."),
                ("corrupt_blocks", "Blocks whose stored copy failed its checksum or was short, recomputed."))
    for name, doc in counters:
        family = CounterMetricFamily(f"pagoda:kv_offload_{name}", doc, labels=labels + ["tier"])
        for tier in ("ram", "disk"):
            counts = getattr(tiers.stats, tier)
            family.add_metric(values + [tier], getattr(counts, "corrupt" if name == "corrupt_blocks" else name))
        yield family
    usage = GaugeMetricFamily("pagoda:kv_offload_blocks", "Blocks each offload tier holds now.",
                              labels=labels + ["tier"])
    usage.add_metric(values + ["ram"], tiers.stats.num_ram_blocks)
    usage.add_metric(values + ["disk"], tiers.stats.num_disk_blocks)
    yield usage


class PoolingExporter:
    """``/metrics`` of a pooling server (an :class:`~pagoda.engine.pooling.AsyncPoolingEngine`), under the
    generation server's names where they apply: every input is a request, a batch is an engine step, and a
    request finishes ``stop`` (pooled), ``error`` or ``abort`` (shut down before it ran). It has no KV cache,
    generated tokens, preemptions or first-token latency, so those names are absent."""

    def __init__(self, engine: Any, model_name: str) -> None:
        from prometheus_client import CollectorRegistry

        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        labels, values = ["model_name"], [self.model_name]
        s = self.engine.stats
        for name, doc, value in (("num_requests_running", "Inputs in the batch being run.", self.engine.num_running),
                                 ("num_requests_waiting", "Inputs waiting for a batch.", self.engine.num_waiting)):
            g = GaugeMetricFamily(f"pagoda:{name}", doc, labels=labels)
            g.add_metric(values, value)
            yield g
        for name, doc, value in (("prompt_tokens", "Prompt tokens received.", s.num_prompt_tokens),
                                 ("engine_steps", "Batches the engine ran.", s.num_steps),
                                 ("engine_step_seconds", "Wall time of those batches.", s.step_seconds)):
            c = CounterMetricFamily(f"pagoda:{name}", doc, labels=labels)
            c.add_metric(values, value)
            yield c
        yield request_success(labels, values, s.finished_by_reason)
        for name, doc, h in (("e2e_request_latency_seconds", "Time from arrival to finish.", s.e2e_request_latency),
                             ("request_queue_time_seconds", "Time from arrival to its batch.", s.request_queue_time)):
            f = HistogramMetricFamily(f"pagoda:{name}", doc, labels=labels)
            f.add_metric(values, h.cumulative(), h.sum)
            yield f


def request_success(labels: list, values: list, finished_by_reason: dict) -> Any:
    """``pagoda:request_success``: finished requests by finish reason, every reason present (0 if none yet)."""
    from prometheus_client.core import CounterMetricFamily

    success = CounterMetricFamily("pagoda:request_success", "Finished requests by finish reason.",
                                  labels=labels + ["finished_reason"])
    reasons = dict.fromkeys(FINISH_REASONS, 0)
    reasons.update({str(k): v for k, v in list(finished_by_reason.items())})
    for reason, n in reasons.items():
        success.add_metric(values + [reason], n)
    return success
