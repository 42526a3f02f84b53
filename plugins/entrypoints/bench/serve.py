"""``pagoda bench serve``: W4 of docs/benchmarks.md against a running ``pagoda serve`` (or any OpenAI-compatible
server).

The W1 requests go to ``/v1/completions`` with streaming, their arrivals a
Poisson process at each ``--request-rate`` (``inf``: all at once). Per request
the client times the first token (TTFT), the gaps between streamed chunks
(ITL), the time per output token after the first (TPOT) and the whole request
(E2E); the summary gives their mean and p50/p90/p99 and the throughputs.

What the server costs: from the server's ``/metrics`` before and after each run,
the engine's mean step time during the run, printed beside the served mean TPOT
with their ratio (1.0: the server adds nothing to a token's time); with
``--offline-output-tok-s`` (the output tok/s ``pagoda bench throughput`` gets
offline), the served output tok/s as a fraction of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from pagoda.plugins.entrypoints.bench.workloads import (BenchRequest, draw_token_ids, fixed_lengths, prefix_groups,
                                                        random_64)


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="W4: the W1 requests streamed to a running server at Poisson arrival rates")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--served-model-name", default=None, help="the 'model' field to send (default: the server's first "
                                                             "model from /v1/models)")
    p.add_argument("--model", default=None, help="checkpoint directory whose tokenizer draws the W1 prompts "
                                                 "(default: the default model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-rate", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0, math.inf],
                   help="arrival rates in requests/s, one run each; 'inf' sends everything at once")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--workload", choices=["w1", "random", "prefix-groups"], default="w1",
                   help="w1: the W1 requests (W4); random: --input-len random prompt tokens asking for --output-len "
                        "tokens each (vLLM's random dataset at a fixed length); "
                        "prefix-groups: --prefix-groups prompt prefixes of --prefix-len "
                        "tokens, interleaved, each request adding 32 tokens of its own and asking for 32 (the "
                        "summary then gives the prefix-cache hit rate and, behind pagoda serve --replicas, how "
                        "often a request reached the replica that served its prefix first)")
    p.add_argument("--input-len", type=int, default=128, help="--workload random: prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="--workload random: output tokens per request")
    p.add_argument("--prefix-groups", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrival times")
    p.add_argument("--result-file", default=None, help="write every run's summary and per-request timings as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--offline-output-tok-s", type=float, default=None,
                   help="the engine's offline output tok/s on the same requests (from pagoda bench throughput); "
                        "each run then prints the served output tok/s as a fraction of it")
    p.add_argument("--offline", action="store_true",
                   help="load the model here too and, right before each run, generate the same requests offline "
                        "(LLM.generate, all at once, the server idle meanwhile): each run then prints the served "
                        "output tok/s as a fraction of that offline figure, measured in the same window. Give "
                        "--model and engine flags matching the server's")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every rate this many times (with --offline: alternated with the offline runs); "
                        "the requests are redrawn for each run so no run hits the prefix cache of another")
    p.add_argument("--profile", action="store_true",
                   help="after each run, where a served token's time went: the engine's step, detokenization, "
                        "output building and response encoding on the server's event loop, and the rest (from "
                        "the server's /metrics)")
    p.set_defaults(func=run_bench_serve)


@dataclass
class RequestTiming:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: Optional[str] = None
    cached_tokens: int = 0
    replica: Optional[str] = None  # pagoda serve --replicas: the replica that served it
    prefix_group: Optional[int] = None

    @property
    def tpot(self) -> Optional[float]:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def bench_requests(ns: argparse.Namespace, draw: int = 0) -> list[BenchRequest]:
    """The requests of ``--workload`` for the model's tokenizer; ``draw`` > 0 draws another set of the same shape
    (W1's fixed requests and the prefix groups' prefixes stay; W1 then gets fresh token ids)."""
    from transformers import AutoTokenizer

    from pagoda.engine.engine_args import load_hf_config
    from pagoda.modeling.default_model import resolve_model_path

    model_dir = resolve_model_path(ns.model)
    config = load_hf_config(model_dir)
    vocab = int(config.get("text_config", config)["vocab_size"])
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    special = set(tokenizer.all_special_ids)
    if ns.workload == "w1":
        requests = random_64(vocab, special, ns.num_prompts)
        if draw:  # W1's lengths, other token ids: a repeated run must not find the last one's prompts cached
            rng = random.Random(draw)
            requests = [BenchRequest(draw_token_ids(rng, len(r.prompt_token_ids), vocab, special), r.output_len)
                        for r in requests]
        return requests
    if ns.workload == "random":
        return fixed_lengths(vocab, special, ns.num_prompts, ns.input_len, ns.output_len, seed=draw)
    return prefix_groups(len(tokenizer), special, ns.num_prompts, ns.prefix_groups, ns.prefix_len)


def w1_requests(model: Optional[str], num_prompts: int) -> list[BenchRequest]:
    ns = argparse.Namespace(model=model, workload="w1", num_prompts=num_prompts)
    return bench_requests(ns)


async def send_one(client, url: str, model: str, req: BenchRequest) -> RequestTiming:
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
            "min_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    timing = RequestTiming(ok=False, prompt_len=len(req.prompt_token_ids), prefix_group=req.prefix_group)
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                timing.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return timing
            timing.replica = resp.headers.get("x-pagoda-replica")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    timing.error = chunk["error"]["message"]
                    return timing
                if chunk.get("usage"):
                    timing.output_tokens = chunk["usage"]["completion_tokens"]
                    timing.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    timing.ttft = now - start
                else:
                    timing.itl.append(now - last)
                last = now
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        timing.error = f"{type(exc).__name__}: {exc}"
        return timing
    timing.e2e = time.perf_counter() - start
    timing.ok = timing.output_tokens > 0 and last is not None
    return timing


async def run_rate(base_url: str, model: str, api_key: Optional[str], requests: list[BenchRequest], rate: float,
                   seed: int, progress: bool) -> tuple[float, list[RequestTiming]]:
    import httpx

    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc=f"rate {rate:g} req/s", dynamic_ncols=True, file=sys.stderr)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits, headers=headers) as client:
        async def timed(req: BenchRequest) -> RequestTiming:
            result = await send_one(client, base_url + "/v1/completions", model, req)
            if bar is not None:
                bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(timed(req)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals: exponential gaps
        timings = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return duration, list(timings)


def percentiles(values) -> dict[str, float]:
    """Mean and p50/p90/p99 in milliseconds of ``values`` in seconds (any sequence or array; linear
    interpolation between ranks)."""
    import numpy as np

    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99]) * 1e3
    return {"mean": float(arr.mean()) * 1e3, "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summary_from(rate: float, duration: float, completed: int, failed: int, prompt_tokens: int, output_tokens: int,
                 ttft, tpot, itl, e2e, errors: list[str]) -> dict:
    """The serving summary from per-request measures in seconds (``pagoda simulate`` reports the same)."""
    return {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "completed": completed,
        "failed": failed,
        "duration_s": duration,
        "request_throughput": completed / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "ttft_ms": percentiles(ttft),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
        "e2e_ms": percentiles(e2e),
        "errors": sorted(set(errors))[:5],
    }


def summarize(rate: float, duration: float, timings: list[RequestTiming]) -> dict:
    ok = [t for t in timings if t.ok]
    summary = summary_from(rate, duration, len(ok), len(timings) - len(ok), sum(t.prompt_len for t in ok),
                           sum(t.output_tokens for t in ok), [t.ttft for t in ok],
                           [t.tpot for t in ok if t.tpot is not None], [gap for t in ok for gap in t.itl],
                           [t.e2e for t in ok], [t.error for t in timings if t.error])
    prompt_tokens = summary["prompt_tokens"]
    summary["prefix_cache_hit_rate"] = sum(t.cached_tokens for t in ok) / prompt_tokens if prompt_tokens else math.nan
    summary.update(routing_locality(ok))
    return summary


def routing_locality(timings: list[RequestTiming]) -> dict:
    """Behind replicas: how many served, and the fraction of a prefix group's later requests that reached the
    replica that served the group first."""
    replicas = {t.replica for t in timings if t.replica}
    if not replicas:
        return {}
    first: dict[int, str] = {}
    later = at_first = 0
    for t in timings:  # in submission order
        if t.prefix_group is None or t.replica is None:
            continue
        if t.prefix_group in first:
            later += 1
            at_first += t.replica == first[t.prefix_group]
        else:
            first[t.prefix_group] = t.replica
    return {"replicas": len(replicas), "to_prefix_replica": at_first / later if later else math.nan}


# the server's counters read before and after each run (behind --replicas, summed over the replicas' engines)
SERVER_COUNTERS = {
    "steps": "pagoda:engine_steps_total",
    "step_seconds": "pagoda:engine_step_seconds_total",
    "detokenize_seconds": "pagoda:serving_detokenize_seconds_total",
    "output_seconds": "pagoda:serving_output_seconds_total",
    "encode_seconds": "pagoda:serving_encode_seconds_total",
    # the engine's own time between two tokens of a request (commit to commit), summed over its tokens
    "itl_seconds": "pagoda:inter_token_latency_seconds_sum",
    "itl_tokens": "pagoda:inter_token_latency_seconds_count",
}


def server_counters(base_url: str, api_key: Optional[str]) -> Optional[dict[str, float]]:
    """The engine's steps and step time so far and the output side's time, from the server's ``/metrics``;
    None when the server does not export the engine's (not pagoda, metrics unreachable, or
    ``--disable-log-stats``)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    names = {name: key for key, name in SERVER_COUNTERS.items()}
    totals: dict[str, float] = {}
    try:
        text = httpx.get(base_url + "/metrics", headers=headers, timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in names:
                    key = names[sample.name]
                    totals[key] = totals.get(key, 0.0) + sample.value
    except (httpx.HTTPError, ValueError):
        return None
    return totals if "steps" in totals else None


def add_server_cost(summary: dict, before: Optional[dict[str, float]], after: Optional[dict[str, float]],
                    offline_output_tps: Optional[float]) -> None:
    """The engine's mean step time during the run against the served mean TPOT, where the output side's time
    went per step, and the served output tok/s against the offline figure."""
    if before is not None and after is not None and after["steps"] > before["steps"]:
        steps = after["steps"] - before["steps"]

        def per_step_ms(key: str) -> float:
            return (after.get(key, 0.0) - before.get(key, 0.0)) / steps * 1e3

        step_ms = per_step_ms("step_seconds")
        summary["engine_steps"] = int(steps)
        summary["engine_mean_step_ms"] = step_ms
        summary["tpot_over_step"] = summary["tpot_ms"]["mean"] / step_ms
        itl_tokens = after.get("itl_tokens", 0.0) - before.get("itl_tokens", 0.0)
        if itl_tokens > 0:
            # what a token waited for at the engine: the steps it sat through and the loop's gaps between them
            engine_itl = (after["itl_seconds"] - before.get("itl_seconds", 0.0)) / itl_tokens * 1e3
            summary["engine_mean_itl_ms"] = engine_itl
            summary["tpot_over_engine_itl"] = summary["tpot_ms"]["mean"] / engine_itl
        # event-loop time per engine step, summed over the requests the step served
        summary["per_step_ms"] = {key: per_step_ms(key) for key in ("detokenize_seconds", "output_seconds",
                                                                    "encode_seconds")}
    if offline_output_tps:
        summary["offline_output_token_throughput"] = offline_output_tps
        summary["served_over_offline"] = summary["output_token_throughput"] / offline_output_tps


def format_profile(s: dict) -> list[str]:
    """Where a served token's time went: each engine step produces one token of every running request, so a
    token waits for a step plus the output work of that step that runs on the event loop; the rest of the
    served TPOT is HTTP writes, waits for the GIL and gaps between steps."""
    if "per_step_ms" not in s:
        return ["(no profile: the server exports no engine step counters; is it pagoda without "
                "--disable-log-stats?)"]
    per = s["per_step_ms"]
    tpot = s["tpot_ms"]["mean"]
    parts = [("engine step (engine thread)", s["engine_mean_step_ms"]),
             ("detokenization + logprobs (event loop)", per["detokenize_seconds"]),
             ("output building (event loop)", per["output_seconds"]),
             ("chunks + JSON (event loop)", per["encode_seconds"])]
    lines = [f"where a served token's time goes (per engine step, mean over {s['engine_steps']} steps):"]
    lines += [f"  {label:<42}{ms:>9.2f} ms  {ms / tpot:>6.1%}" for label, ms in parts]
    rest = tpot - sum(ms for _, ms in parts)
    lines.append(f"  {'rest: HTTP writes, GIL waits, idle gaps':<42}{rest:>9.2f} ms  {rest / tpot:>6.1%}")
    lines.append(f"  {'served mean TPOT':<42}{tpot:>9.2f} ms")
    return lines


def format_summary(s: dict, profile: bool = False) -> str:
    lines = [
        f"==== pagoda bench serve (W4): request rate {s['request_rate']} req/s ====",
        f"{'completed / failed requests':<30}{s['completed']} / {s['failed']}",
        f"{'duration (s)':<30}{s['duration_s']:.2f}",
        f"{'request throughput (req/s)':<30}{s['request_throughput']:.3f}",
        f"{'output tokens/s':<30}{s['output_token_throughput']:.1f}",
        f"{'total tokens/s':<30}{s['total_token_throughput']:.1f}",
        f"{'prompt / output tokens':<30}{s['prompt_tokens']} / {s['output_tokens']}",
        f"{'(ms)':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        row = s[key]
        lines.append(f"{label:<10}" + "".join(f"{row[c]:>10.1f}" for c in ("mean", "p50", "p90", "p99")))
    lines.append(f"{'prefix-cache hit rate':<30}{s['prefix_cache_hit_rate']:.1%}")
    if "engine_mean_step_ms" in s:
        lines.append(f"{'engine mean step (ms)':<30}{s['engine_mean_step_ms']:.1f}")
        lines.append(f"{'served mean TPOT / step':<30}{s['tpot_over_step']:.2f}x")
    if "engine_mean_itl_ms" in s:
        lines.append(f"{'engine time per token (ms)':<30}{s['engine_mean_itl_ms']:.1f}")
        lines.append(f"{'served mean TPOT / engine':<30}{s['tpot_over_engine_itl']:.3f}x "
                     f"(the server adds {s['tpot_ms']['mean'] - s['engine_mean_itl_ms']:+.1f} ms per token)")
    if "served_over_offline" in s:
        lines.append(f"{'offline output tokens/s':<30}{s['offline_output_token_throughput']:.1f}")
        lines.append(f"{'served / offline tokens/s':<30}{s['served_over_offline']:.1%}")
    if "replicas" in s:
        lines.append(f"{'replicas that served':<30}{s['replicas']}")
        lines.append(f"{'at their prefix group replica':<30}{s['to_prefix_replica']:.1%}")
    if profile:
        lines += format_profile(s)
    for err in s["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def run_bench_serve(ns: argparse.Namespace) -> int:
    import httpx

    base_url = ns.base_url.rstrip("/")
    model = ns.served_model_name
    if model is None:
        headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
        try:
            model = httpx.get(base_url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            print(f"pagoda bench serve: error: cannot list the models of {base_url} ({exc}); is `pagoda serve` "
                  "running there? pass --base-url", file=sys.stderr)
            return 2
    if ns.repeat < 1:
        print("pagoda bench serve: error: --repeat must be at least 1", file=sys.stderr)
        return 2
    requests = bench_requests(ns)
    title = {"w1": "W4: W1", "random": f"random {ns.input_len} in / {ns.output_len} out:"}.get(
        ns.workload, f"{ns.prefix_groups} prefix groups:")
    print(f"{title} {len(requests)} requests ({sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
          f"{sum(r.output_len for r in requests)} output tokens) to {base_url} as model {model!r}")
    offline_llm = _offline_llm(ns) if ns.offline else None
    results = []
    for rep in range(ns.repeat):
        if rep:  # fresh prompts: a repeated run must not find the previous one's prefixes in the cache
            requests = bench_requests(ns, draw=rep)
        for rate in ns.request_rate:
            offline_tps = ns.offline_output_tok_s
            if offline_llm is not None:
                offline_tps = _run_offline(offline_llm, requests)
            before = server_counters(base_url, ns.api_key)
            duration, timings = asyncio.run(run_rate(base_url, model, ns.api_key, requests, rate, ns.seed,
                                                     not ns.no_progress))
            summary = summarize(rate, duration, timings)
            add_server_cost(summary, before, server_counters(base_url, ns.api_key), offline_tps)
            print(format_summary(summary, ns.profile), flush=True)
            results.append({"summary": summary, "requests": [asdict(t) for t in timings]})
    if offline_llm is not None and ns.repeat > 1:
        for rate in ns.request_rate:
            ratios = sorted(r["summary"]["served_over_offline"] for r in results
                            if r["summary"]["request_rate"] == (rate if math.isfinite(rate) else "inf"))
            print(f"rate {rate:g}: served / offline output tok/s over {len(ratios)} alternated runs: "
                  + ", ".join(f"{x:.1%}" for x in ratios) + f"; median {ratios[len(ratios) // 2]:.1%}")
    if ns.result_file:
        with open(ns.result_file, "w") as f:
            json.dump({"base_url": base_url, "model": model, "num_prompts": len(requests), "runs": results}, f,
                      indent=2)
        print(f"results written to {ns.result_file}")
    return 0 if all(r["summary"]["failed"] == 0 for r in results) else 1


def _offline_llm(ns: argparse.Namespace):
    """The engine the offline runs use: ``--model`` with the engine's defaults, at the thread count it measures now."""
    from pagoda.engine.llm import LLM

    llm = LLM(model=ns.model) if ns.model else LLM()
    llm.engine.host.hold_threads()
    return llm


def _run_offline(llm, requests: list[BenchRequest]) -> float:
    """Output tok/s of ``requests`` generated offline, all submitted at once (as ``pagoda bench throughput``)."""
    from pagoda.plugins.entrypoints.bench.throughput import run_pagoda

    result, _ = run_pagoda(llm, requests)
    print(f"offline, same requests: {result.output_tps:.1f} output tok/s", flush=True)
    return result.output_tps
