"""``pagoda bench serve``: W4 of docs/benchmarks.md against a running ``pagoda serve`` (or any OpenAI-compatible
server).

The W1 requests go to ``/v1/completions`` with streaming, their arrivals a
Poisson process at each ``--request-rate`` (``inf``: all at once). Per request
the client times the first token (TTFT), the gaps between streamed chunks
(ITL), the time per output token after the first (TPOT) and the whole request
(E2E); the summary gives their mean and p50/p90/p99 and the throughputs. The
timings are defined as vLLM's serving client defines them (every streamed
message with choices is a token event; E2E ends at the last one; TPOT is
``(E2E - TTFT) / (output tokens - 1)``), and ``--workload vllm-random`` sends
what that client sends: its random dataset's text prompts, its arrival times,
its request body (see ``vllm_client.py``), so the two clients' figures agree.

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

from pagoda.plugins.entrypoints.bench.vllm_client import (SSEReader, completion_body, vllm_arrival_times,
                                                          vllm_random_requests)
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
    p.add_argument("--workload", "--dataset", choices=["w1", "random", "vllm-random", "prefix-groups"], default="w1",
                   help="w1: the W1 requests (W4); random: --input-len random prompt tokens asking for --output-len "
                        "tokens each, greedy (the shape of vLLM's random dataset); vllm-random: what vLLM's serving "
                        "client sends with --dataset-name random and the same --seed: its text prompts, arrival "
                        "times (--burstiness), request body (no temperature unless --temperature: the server's "
                        "default sampling); "
                        "prefix-groups: --prefix-groups prompt prefixes of --prefix-len "
                        "tokens, interleaved, each request adding 32 tokens of its own and asking for 32 (the "
                        "summary then gives the prefix-cache hit rate and, behind pagoda serve --replicas, how "
                        "often a request reached the replica that served its prefix first)")
    p.add_argument("--input-len", type=int, default=128, help="--workload random: prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="--workload random: output tokens per request")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="--workload vllm-random: lengths drawn uniformly within this ratio of --input-len and "
                        "--output-len (vLLM's flag of that name)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="--workload vllm-random: the arrival gaps' gamma shape (1: Poisson; lower: burstier)")
    p.add_argument("--temperature", type=float, default=None,
                   help="--workload vllm-random: the temperature to send (default: none, as vLLM's client: the "
                        "server's default, 1.0 for pagoda and vLLM on a model whose generation config sets none)")
    p.add_argument("--extra-body", default=None, metavar="JSON",
                   help="--workload vllm-random: more request fields, a JSON object (as vLLM's --extra-body)")
    p.add_argument("--prefix-groups", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrival times (vllm-random: of its "
                                                       "prompts and arrival times, as vLLM's --seed)")
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
    from pagoda.engine.components import load_tokenizer
    from pagoda.engine.engine_args import load_hf_config
    from pagoda.modeling.default_model import resolve_model_path

    model_dir = resolve_model_path(ns.model)
    config = load_hf_config(model_dir)
    vocab = int(config.get("text_config", config)["vocab_size"])
    tokenizer = load_tokenizer(str(model_dir), None)  # the server's own load (AutoTokenizer's tokenizer)
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
    if ns.workload == "vllm-random":  # another draw is vLLM's client with the next --seed
        return vllm_random_requests(tokenizer, ns.num_prompts, ns.input_len, ns.output_len, ns.random_range_ratio,
                                    ns.seed + draw)
    return prefix_groups(len(tokenizer), special, ns.num_prompts, ns.prefix_groups, ns.prefix_len)


def w1_requests(model: Optional[str], num_prompts: int) -> list[BenchRequest]:
    ns = argparse.Namespace(model=model, workload="w1", num_prompts=num_prompts)
    return bench_requests(ns)


def greedy_body(model: str, req: BenchRequest) -> dict:
    """The body of pagoda's own workloads: the prompt's token ids, greedy, exactly ``output_len`` tokens."""
    return {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
            "min_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def bench_session(headers: Optional[dict] = None) -> "aiohttp.ClientSession":
    """The HTTP client of the served benchmarks: aiohttp, as vLLM's serving client uses, with no limit on open
    connections. A client on the server's machine takes CPU from its engine for every chunk it reads: httpx's
    took more than aiohttp's, and the engine's steps ran slower under it (mean TPOT 1.14x vLLM's client's
    against 1.00x with aiohttp; docs/serving_speed.md)."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=3600.0))


async def send_one(session, url: str, body: dict, req: BenchRequest) -> RequestTiming:
    """Stream one completion through ``session`` (:func:`bench_session`), timed as vLLM's client times it: each
    message with choices is a token event, stamped when the read that completed it arrived; the request ends at
    its last token event."""
    timing = RequestTiming(ok=False, prompt_len=len(req.prompt_token_ids), prefix_group=req.prefix_group)
    start = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                timing.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return timing
            timing.replica = resp.headers.get("x-pagoda-replica")
            reader = SSEReader()
            async for raw in resp.content.iter_any():
                now = time.perf_counter()
                for message in reader.feed(raw):
                    if not message.startswith("data: ") or message == "data: [DONE]":
                        continue
                    chunk = json.loads(message[6:])
                    if "error" in chunk:
                        timing.error = chunk["error"]["message"]
                        return timing
                    if chunk.get("choices"):
                        if last is None:
                            timing.ttft = now - start
                        else:
                            timing.itl.append(now - last)
                        last = now
                    elif chunk.get("usage"):
                        timing.output_tokens = chunk["usage"]["completion_tokens"]
                        timing.prompt_len = chunk["usage"].get("prompt_tokens", timing.prompt_len)
                        details = chunk["usage"].get("prompt_tokens_details") or {}
                        timing.cached_tokens = details.get("cached_tokens", 0)
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        timing.error = f"{type(exc).__name__}: {exc}"
        return timing
    timing.ok = timing.output_tokens > 0 and last is not None
    if timing.ok:
        timing.e2e = last - start
    elif timing.error is None:
        timing.error = "the stream ended without a token or without its usage"
    return timing


async def run_rate(base_url: str, api_key: Optional[str], requests: list[BenchRequest], bodies: list[dict],
                   arrivals: list[float], progress: bool, label: str) -> tuple[float, list[RequestTiming]]:
    """Send ``bodies[i]`` at ``arrivals[i]`` seconds after the start; the run's wall time and each request's timing.
    Nothing goes before the run: vLLM's client (0.32) skips its lone test request unless given
    ``--ready-check-timeout-sec``, and a lone request would also put the first prompt in the prefix cache."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc=label, dynamic_ncols=True, file=sys.stderr)
    url = base_url + "/v1/completions"
    async with bench_session(headers) as session:
        async def timed(req: BenchRequest, body: dict) -> RequestTiming:
            result = await send_one(session, url, body, req)
            if bar is not None:
                bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for req, body, at in zip(requests, bodies, arrivals):
            wait = start + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(timed(req, body)))
        timings = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return duration, list(timings)


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """pagoda's own arrivals: the first request at once, then exponential gaps from ``random.Random(seed)``."""
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(num_requests):
        times.append(t)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    return times


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
    try:
        sampling = request_fields(ns)
        requests = bench_requests(ns)
        vllm_arrival_times(1, 1.0, ns.burstiness)  # a bad --burstiness fails before any run
    except ValueError as exc:
        print(f"pagoda bench serve: error: {exc}", file=sys.stderr)
        return 2
    title = {"w1": "W4: W1", "random": f"random {ns.input_len} in / {ns.output_len} out:",
             "vllm-random": f"vLLM's random dataset, {ns.input_len} in / {ns.output_len} out, seed {ns.seed}:"}.get(
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
            like_vllm = ns.workload == "vllm-random"
            if like_vllm:
                bodies = [completion_body(model, r, sampling=sampling) for r in requests]
                arrivals = vllm_arrival_times(len(requests), rate, ns.burstiness, ns.seed + rep)
            else:
                bodies = [greedy_body(model, r) for r in requests]
                arrivals = poisson_arrivals(len(requests), rate, ns.seed)
            before = server_counters(base_url, ns.api_key)
            duration, timings = asyncio.run(run_rate(base_url, ns.api_key, requests, bodies, arrivals,
                                                     not ns.no_progress, f"rate {rate:g} req/s"))
            summary = summarize(rate, duration, timings)
            add_server_cost(summary, before, server_counters(base_url, ns.api_key), offline_tps)
            print(format_summary(summary, ns.profile), flush=True)
            results.append({"summary": summary, "vllm_names": vllm_metrics(summary),
                            "requests": [asdict(t) for t in timings]})
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


def request_fields(ns: argparse.Namespace) -> dict:
    """The sampling fields ``--workload vllm-random`` adds to each request: ``--temperature``, ``--extra-body``."""
    fields = {}
    if ns.temperature is not None:
        fields["temperature"] = ns.temperature
    if ns.extra_body:
        try:
            extra = json.loads(ns.extra_body)
        except ValueError as exc:
            raise ValueError(f"--extra-body is not JSON ({exc}); give an object such as '{{\"top_p\": 0.9}}'")
        if not isinstance(extra, dict):
            raise ValueError(f"--extra-body must be a JSON object, not {type(extra).__name__}")
        fields.update(extra)
    if fields and ns.workload != "vllm-random":
        raise ValueError("--temperature and --extra-body apply to --workload vllm-random only (the other workloads "
                         "are greedy, exactly --output-len tokens)")
    return fields


def vllm_metrics(summary: dict) -> dict:
    """The summary under the names of vLLM's client's result JSON (``--save-result``)."""
    out = {"completed": summary["completed"], "failed": summary["failed"], "duration": summary["duration_s"],
           "request_throughput": summary["request_throughput"],
           "output_throughput": summary["output_token_throughput"],
           "total_token_throughput": summary["total_token_throughput"],
           "total_input_tokens": summary["prompt_tokens"], "total_output_tokens": summary["output_tokens"]}
    for key, name in (("ttft_ms", "ttft"), ("tpot_ms", "tpot"), ("itl_ms", "itl"), ("e2e_ms", "e2el")):
        row = summary[key]
        out.update({f"mean_{name}_ms": row["mean"], f"median_{name}_ms": row["p50"], f"p90_{name}_ms": row["p90"],
                    f"p99_{name}_ms": row["p99"]})
    return out


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
