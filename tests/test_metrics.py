"""EngineStats and the Prometheus exporter, over the real scheduler and KV block manager."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv.blocks import PagedKVCacheManager
from pagoda.engine.metrics import (ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, EngineStats, Histogram,
                            PrometheusExporter)
from pagoda.scheduling import Scheduler
from pagoda.sampling_params import SamplingParams
from pagoda.sequence import Sequence, SequenceStatus


def make_parts(num_blocks=8):
    cache = CacheConfig(block_size=16, kv_cache_memory_bytes=1 << 20, kv_cache_dtype="auto",
                        enable_prefix_caching=True, num_gpu_blocks_override=None, swap_space_bytes=0,
                        preemption_mode="recompute", kv_allocator="paged")
    sched_cfg = SchedulerConfig(policy="fcfs", max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128,
                                enable_chunked_prefill=True, long_prefill_token_threshold=0,
                                max_waiting_requests=None)
    kv = PagedKVCacheManager(num_blocks, 16)
    return Scheduler(sched_cfg, cache, kv), kv


def scrape(exporter):
    samples = {}
    for family in text_string_to_metric_families(exporter.render().decode()):
        for s in family.samples:
            key = (s.name,) + tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[key] = s.value
    return samples


def test_histogram_buckets_are_cumulative_with_inclusive_upper_bounds():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 4), ("+Inf", 5)]
    assert h.count == 5 and h.sum == 0.05 + 0.1 + 0.5 + 1.0 + 7.0


def test_buckets_are_vllms():
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80.0 and len(ITL_BUCKETS) == 19
    assert REQUEST_LATENCY_BUCKETS[0] == 0.3 and REQUEST_LATENCY_BUCKETS[-1] == 7680.0
    assert len(REQUEST_LATENCY_BUCKETS) == 21


def test_first_token_is_a_ttft_sample_and_later_tokens_are_inter_token_samples():
    stats = EngineStats()
    req = Sequence("r", [1, 2, 3], SamplingParams(), arrival_time=10.0)
    req.scheduled_time = 10.5
    stats.on_arrival(3)
    stats.on_step(None, [req], now=11.0)
    stats.on_step(None, [req], now=11.25)
    stats.on_step(None, [req], now=11.75)
    req.status = SequenceStatus.FINISHED_LENGTH
    stats.on_finished(req, now=12.0)
    assert stats.time_to_first_token.count == 1 and stats.time_to_first_token.sum == 1.0
    assert stats.inter_token_latency.count == 2 and stats.inter_token_latency.sum == 0.75
    assert stats.e2e_request_latency.sum == 2.0 and stats.request_queue_time.sum == 0.5
    assert stats.num_generation_tokens == 3 and stats.num_prompt_tokens == 3
    assert stats.finished_by_reason == {"length": 1}
    assert not stats._last_token_time  # nothing kept for finished requests


def test_exporter_reads_live_gauges_from_the_scheduler_and_kv_manager():
    sched, kv = make_parts(num_blocks=8)
    exporter = PrometheusExporter(EngineStats(), sched, kv, "m")
    before = scrape(exporter)
    assert before[("pagoda:num_requests_running",)] == 0 and before[("pagoda:kv_cache_usage_perc",)] == 0
    for i in range(3):
        sched.add_request(Sequence(f"r{i}", list(range(40)), SamplingParams()))
    sched.schedule()  # admits all three: 3 blocks each of 8
    after = scrape(exporter)
    assert after[("pagoda:num_requests_running",)] == 3
    assert after[("pagoda:kv_cache_usage_perc",)] == kv.usage > 0
    assert after[("pagoda:prefix_cache_queries_total",)] == kv.stats.queries == 120
    assert after[("pagoda:prefix_cache_hits_total",)] == kv.stats.hits


def test_exporter_names_follow_vllm_with_the_pagoda_prefix_and_carry_the_model_name():
    sched, kv = make_parts()
    stats = EngineStats()
    stats.finished_by_reason["stop"] += 2
    stats.time_to_first_token.observe(0.02)
    exporter = PrometheusExporter(stats, sched, kv, "my-model")
    text = exporter.render().decode()
    samples = scrape(exporter)
    assert samples[("pagoda:request_success_total", ("finished_reason", "stop"))] == 2
    assert samples[("pagoda:request_success_total", ("finished_reason", "length"))] == 0
    assert samples[("pagoda:time_to_first_token_seconds_bucket", ("le", "0.02"))] == 1
    assert samples[("pagoda:time_to_first_token_seconds_bucket", ("le", "0.01"))] == 0
    assert samples[("pagoda:time_to_first_token_seconds_count",)] == 1
    assert 'model_name="my-model"' in text
    names = {key[0] for key in samples}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total", "time_to_first_token_seconds_sum", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket"):
        assert "pagoda:" + name in names, name
