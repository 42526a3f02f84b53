"""``pagoda bench prefix`` (W2): requests sharing one long prefix, with and without prefix caching.

With ``--num-prefixes K`` the requests share K prefixes and arrive in waves of one request per prefix,
each wave when the last one has finished, so the prefixes compete for a small KV pool between waves.
Given ``--kv-offload-*`` flags, the two runs compared are prefix caching with and without the offload
tiers (blocks evicted from the pool come back from RAM or disk instead of being recomputed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from pagoda.cli import add_engine_args, engine_args_from
from pagoda.kv.tiers import has_offload_tiers
from pagoda.plugins.entrypoints.bench.workloads import BenchRequest, shared_prefix


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="W2: 64 requests sharing a 1,024-token prefix; with vs without prefix caching")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prefixes", type=int, default=1,
                   help="distinct shared prefixes; above 1 the requests arrive in waves of one per prefix")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode; medians are reported")
    add_engine_args(p)
    p.set_defaults(func=run_prefix)


@dataclass
class PrefixRun:
    mean_ttft: float  # seconds from submission (all at once) to each request's first token, averaged
    total: float  # seconds until the last request finished
    # the same two in CPU seconds of this process: on a shared machine, wall time also counts other
    # processes' turns on the cores, CPU time only the work done
    mean_ttft_cpu: float
    total_cpu: float
    queries: int  # prompt tokens looked up in the prefix cache
    hits: int  # of which found there

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def run_workload(llm, requests: list[BenchRequest], tag: str, wave_size: int = 0) -> PrefixRun:
    """Submit the requests (all at once, or ``wave_size`` at a time, each wave once the last has finished),
    step to completion, time each request's first token from its submission."""
    from pagoda.sampling_params import SamplingParams

    engine = llm.engine
    stats = engine.kv_manager.stats
    queries, hits = stats.queries, stats.hits
    start, start_cpu = time.perf_counter(), time.process_time()
    first_token: dict[str, tuple[float, float]] = {}  # request id -> (wall, CPU) seconds to its first token
    wave_size = wave_size or len(requests)
    for first in range(0, len(requests), wave_size):
        submitted = (time.perf_counter(), time.process_time())
        for i, r in enumerate(requests[first:first + wave_size], start=first):
            params = SamplingParams(temperature=0.0, max_tokens=r.output_len, min_tokens=r.output_len,
                                    ignore_eos=True)
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = (time.perf_counter() - submitted[0], time.process_time() - submitted[1])
            for out in outputs:
                if out.outputs[0].token_ids and out.request_id not in first_token:
                    first_token[out.request_id] = now
    return PrefixRun(statistics.mean(w for w, _ in first_token.values()), time.perf_counter() - start,
                     statistics.mean(c for _, c in first_token.values()), time.process_time() - start_cpu,
                     stats.queries - queries, stats.hits - hits)


def make_llm(ns: argparse.Namespace, enable_prefix_caching: bool, offload: bool = False):
    from pagoda.engine.llm import LLM

    overrides = {} if offload else dict(kv_offload_ram=0.0, kv_offload_disk=None, kv_offload_disk_size=0.0)
    args = engine_args_from(ns, enable_prefix_caching=enable_prefix_caching, **overrides)
    return LLM(**args.model_dump(exclude_defaults=True), plugin_manager=ns.plugin_manager)


def interleaved_prefixes(vocab: int, special: set[int], ns: argparse.Namespace) -> list[BenchRequest]:
    """``ns.num_requests`` requests over ``ns.num_prefixes`` prefixes, one per prefix in turn."""
    groups = [shared_prefix(vocab, special, -(-ns.num_requests // ns.num_prefixes), ns.prefix_len, ns.suffix_len,
                            ns.output_len, seed=100 + g) for g in range(ns.num_prefixes)]
    return [group[i] for i in range(len(groups[0])) for group in groups][:ns.num_requests]


def median_run(runs: list[PrefixRun]) -> PrefixRun:
    return PrefixRun(*(statistics.median(getattr(r, name) for r in runs)
                       for name in ("mean_ttft", "total", "mean_ttft_cpu", "total_cpu")),
                     runs[-1].queries, runs[-1].hits)


def run_prefix(ns: argparse.Namespace) -> int:
    if ns.num_prefixes < 1:
        raise SystemExit(f"--num-prefixes {ns.num_prefixes}: pass at least 1")
    offload = bool(ns.kv_offload_ram or ns.kv_offload_disk)
    # the mode measured (True) against the baseline (False): offload tiers on/off, else prefix caching on/off
    engines = {mode: make_llm(ns, enable_prefix_caching=mode or offload, offload=mode and offload)
               for mode in (True, False)}
    name = "KV offload" if offload else "prefix caching"
    llm = engines[True]
    engine = llm.engine
    vocab, special = engine.config.model.vocab_size, set(llm.get_tokenizer().all_special_ids)
    if ns.num_prefixes > 1:
        requests = interleaved_prefixes(vocab, special, ns)
    else:
        requests = shared_prefix(vocab, special, ns.num_requests, ns.prefix_len, ns.suffix_len, ns.output_len)
    wave = ns.num_prefixes if ns.num_prefixes > 1 else 0
    # warm-up on another prefix, so the measured runs find the cache cold
    warmup = shared_prefix(vocab, special, 4, min(ns.prefix_len, 64), ns.suffix_len, 4, seed=1)
    print(f"model: {engine.config.model.model}  dtype: {str(engine.config.model.dtype).replace('torch.', '')}  "
          f"threads: {engine.num_threads}  KV blocks: {engine.num_blocks} x {engine.config.cache.block_size}")
    if engine.window_pool is not None:
        print(f"KV window pool: {engine.window_pool.summary()}")
    print(f"W2: {len(requests)} requests, a {ns.prefix_len}-token shared prefix (of {ns.num_prefixes}) + "
          f"{ns.suffix_len} distinct tokens each, {ns.output_len} output tokens each, median of {ns.repeats}"
          + (f", in waves of {wave}" if wave else ""))
    runs: dict[bool, list[PrefixRun]] = {True: [], False: []}
    for llm in engines.values():
        run_workload(llm, warmup, "warmup")
    # the two modes take turns, so a change in the machine's load falls on both
    for repeat in range(ns.repeats):
        for caching, llm in engines.items():
            llm.engine.kv_manager.reset_prefix_cache()  # every repeat starts cold
            runs[caching].append(run_workload(llm, requests, f"w2-{repeat}", wave))
    cached, uncached = median_run(runs[True]), median_run(runs[False])
    width = len(f"without {name}")
    for label, run in ((f"with {name}".ljust(width), cached), (f"without {name}", uncached)):
        print(f"{label}: mean TTFT {run.mean_ttft:8.3f} s  total {run.total:8.2f} s   "
              f"(CPU seconds: mean TTFT {run.mean_ttft_cpu:8.3f}  total {run.total_cpu:8.2f})")
    print(f"prefix cache hit rate: {cached.hit_rate:.1%} ({cached.hits} of {cached.queries} prompt tokens)")
    kv = engines[True].engine.kv_manager
    tiers = kv.tiers if has_offload_tiers(kv) else None
    if tiers is not None:
        for tier in ("ram", "disk"):
            counts = getattr(tiers.stats, tier)
            print(f"KV offload {tier}: {counts.hits} block hits, {counts.misses} misses, "
                  f"{counts.stored_bytes / 2**20:.1f} MiB stored, {counts.loaded_bytes / 2**20:.1f} MiB loaded, "
                  f"{counts.corrupt} corrupt")
    print(f"ratio without / with {name}: mean TTFT {uncached.mean_ttft / cached.mean_ttft:.1f}x, "
          f"total time {uncached.total / cached.total:.1f}x   (CPU time: mean TTFT "
          f"{uncached.mean_ttft_cpu / cached.mean_ttft_cpu:.1f}x, total {uncached.total_cpu / cached.total_cpu:.1f}x)")
    return 0
