"""What the HTTP client costs a server on the same machine: the same streamed requests sent through aiohttp (as
vLLM's serving client and ``pagoda bench serve`` send them) and through the official ``openai`` client, alternated
on one running server, each run's TTFT, TPOT and the client's own CPU time.

Usage, against any OpenAI-compatible server already running (pagoda's or vLLM's)::

    python contrib/serving-comparison/client_cost.py --base-url http://127.0.0.1:8000 --rounds 3

The requests are vLLM's ``random`` dataset for the served model's tokenizer (128 tokens in, 64 out, no EOS) at
``--request-rate`` with vLLM's client's arrival times, the same in every run. Start the server with
``--no-enable-prefix-caching``: every run sends the same prompts, so with the prefix cache the runs after the
first would hit it. Runs alternate A O O A, A O O A, ...; the table gives the means over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

CLIENTS = ("aiohttp", "openai")


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=30) as reply:
        return json.load(reply)["data"][0]["id"]


def tokenizer_dir(served_name: str, given: Optional[str]) -> str:
    """Where the served model's tokenizer is: ``given``, else the served name where it is a directory, else the
    default model's where the name is the default model's."""
    from pagoda.modeling.default_model import ensure_default_model

    if given:
        return given
    if Path(served_name).is_dir():
        return served_name
    default = ensure_default_model()
    if served_name == default.name:
        return str(default)
    raise SystemExit(f"the server serves {served_name!r}, which is not a directory here: pass --tokenizer DIR (the "
                     "served model's checkpoint or tokenizer directory)")


async def stream_openai(client, body: dict) -> tuple[Optional[float], list[float]]:
    """One stream through the ``openai`` client: time to the first token and the gaps after it (seconds)."""
    start = time.perf_counter()
    ttft, last, gaps = None, None, []
    stream = await client.completions.create(
        model=body["model"], prompt=body["prompt"], max_tokens=body["max_tokens"], stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "repetition_penalty": body["repetition_penalty"]})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            if last is None:
                ttft = now - start
            else:
                gaps.append(now - last)
            last = now
    return ttft, gaps


async def one_run(how: str, base_url: str, requests, bodies: list[dict], arrivals: list[float]) -> dict:
    """Every request at its arrival time through client ``how``; the run's figures."""
    from pagoda.plugins.entrypoints.bench.serve import bench_session, send_one

    from pagoda.plugins.entrypoints.bench.serve import server_counters

    before = server_counters(base_url, None)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()

    async def paced(make):
        tasks = []
        for i, at in enumerate(arrivals):
            wait = start + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(make(i)))
        return await asyncio.gather(*tasks)

    if how == "openai":
        import httpx
        import openai

        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0,
                                    http_client=openai.DefaultAsyncHttpxClient(
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                                        timeout=3600.0))
        results = await paced(lambda i: stream_openai(client, bodies[i]))
        await client.close()
    else:
        async with bench_session() as session:
            timings = await paced(lambda i: send_one(session, base_url + "/v1/completions", bodies[i], requests[i]))
        bad = [t.error for t in timings if not t.ok]
        if bad:
            raise RuntimeError(f"{len(bad)} requests failed, the first: {bad[0]}")
        results = [(t.ttft, t.itl) for t in timings]
    duration = time.perf_counter() - start
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    after = server_counters(base_url, None)
    tpots = sorted(sum(gaps) / len(gaps) for _, gaps in results if gaps)
    run = {"output_tok_s": sum(len(gaps) + 1 for _, gaps in results) / duration,
           "mean_ttft_ms": 1e3 * statistics.fmean(ttft for ttft, _ in results),
           "mean_tpot_ms": 1e3 * statistics.fmean(tpots),
           "p99_tpot_ms": 1e3 * tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))],
           "client_cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)}
    # pagoda's server: what a token waited for at the engine (the steps it sat through), whatever the client
    if before is not None and after is not None and after.get("itl_tokens", 0) > before.get("itl_tokens", 0):
        run["engine_itl_ms"] = 1e3 * (after["itl_seconds"] - before.get("itl_seconds", 0.0)) / (
            after["itl_tokens"] - before.get("itl_tokens", 0.0))
    return run


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--tokenizer", default=None, help="the served model's tokenizer directory (default: the served "
                   "model's name where it is a directory, as for a server started with --model DIR; else the default "
                   "model's, for a server started without --model)")
    p.add_argument("--request-rate", type=float, default=8.0)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="each round runs every client twice")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    if ns.rounds < 1 or ns.num_prompts < 1 or not ns.request_rate > 0:
        p.error("--rounds, --num-prompts and --request-rate must be above 0")

    from transformers import AutoTokenizer

    from pagoda.plugins.entrypoints.bench.vllm_client import completion_body, vllm_arrival_times, vllm_random_requests

    # both clients imported before any run: a run's CPU time is its streams', not an import's
    import httpx  # noqa: F401
    import openai  # noqa: F401

    from pagoda.plugins.entrypoints.bench.serve import bench_session  # noqa: F401 - aiohttp with it

    name = served_model(ns.base_url)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(name, ns.tokenizer))
    requests = vllm_random_requests(tokenizer, ns.num_prompts, 128, 64, seed=ns.seed)
    bodies = [completion_body(name, r) for r in requests]
    arrivals = vllm_arrival_times(ns.num_prompts, ns.request_rate, 1.0, ns.seed)
    order = [c for r in range(ns.rounds) for c in ((CLIENTS[0], CLIENTS[1], CLIENTS[1], CLIENTS[0]) if r % 2 == 0
                                                   else (CLIENTS[1], CLIENTS[0], CLIENTS[0], CLIENTS[1]))][:2 * ns.rounds * 2]
    runs: dict[str, list[dict]] = {c: [] for c in CLIENTS}
    for how in order:
        run = asyncio.run(one_run(how, ns.base_url, requests, bodies, arrivals))
        runs[how].append(run)
        print(how, json.dumps({k: round(v, 2) for k, v in run.items()}), flush=True)
    keys = [("output_tok_s", "output tok/s"), ("mean_ttft_ms", "mean TTFT (ms)"), ("mean_tpot_ms", "mean TPOT (ms)"),
            ("p99_tpot_ms", "p99 TPOT (ms)"), ("client_cpu_s", "client CPU for the run (s)"),
            ("engine_itl_ms", "engine time per token (ms; pagoda's /metrics)")]
    print(f"\n{ns.num_prompts} requests at {ns.request_rate:g}/s against {name}, means of {len(runs['aiohttp'])} "
          "runs each\n")
    print("| | aiohttp | openai | openai / aiohttp |\n|---|---|---|---|")
    for key, label in keys:
        if any(key not in r for c in CLIENTS for r in runs[c]):
            continue  # a server without pagoda's metrics
        a, o = (statistics.fmean(r[key] for r in runs[c]) for c in CLIENTS)
        print(f"| {label} | {a:.2f} | {o:.2f} | {o / a:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
