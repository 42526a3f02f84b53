"""Prefill and decode apart on one 2-core machine, against one engine on both cores, under a mixed load:

    python contrib/disaggregation/mixed_load.py /tmp/pd-run --rounds 2

It starts, on the default model (or ``--model``), a prefill instance pinned to core 0 and a decode instance pinned
to core 1 (``pagoda serve --cpu-threads 1 --kv-connector shared-disk --kv-role prefill|decode``) with
``pagoda kv-proxy`` in front, and one ``pagoda serve --cpu-threads 2`` on both cores. Then, alternately, each
setup gets the same load (fresh prompts every round, the same for both setups in a round): Poisson arrivals at
``--rate``, a ``--long-fraction`` of them ``--long-len``-token prompts asking for ``--long-out`` tokens, the others
``--short-len``-token chats asking for ``--short-out`` tokens, streamed with the official ``openai`` client.
Per run it prints TTFT and TPOT p50/p99 (TPOT: the time after the first token over the tokens after it) and the
goodput under ``--ttft-slo-ms`` and ``--tpot-slo-ms`` (requests per second that met both), and at the end each
figure of the split over the one engine's, run by run. Only loopback addresses are used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from pagoda.modeling.default_model import ensure_default_model
from pagoda.plugins.entrypoints.server import free_port

PAGODA = str(Path(sys.executable).with_name("pagoda"))


def start(log: Path, args: list[str], cores: str, timeout: float = 300) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(["taskset", "-c", cores, PAGODA, *args, "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"pagoda {args[0]} did not come up:\n{log.read_text()[-3000:]}")


def workload(ns: argparse.Namespace, round_index: int) -> list[tuple[float, list[int], int]]:
    """(arrival, prompt token ids, max_tokens) of one round."""
    rng = random.Random(f"{ns.seed}-{round_index}")
    out, t = [], 0.0
    for _ in range(ns.num_requests):
        t += rng.expovariate(ns.rate)
        long = rng.random() < ns.long_fraction
        length = ns.long_len if long else ns.short_len
        out.append((t, [rng.randrange(1000, 40000) for _ in range(length)], ns.long_out if long else ns.short_out))
    return out


async def drive(url: str, requests: list[tuple[float, list[int], int]]) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    start = time.perf_counter()

    async def one(arrival: float, prompt: list[int], max_tokens: int) -> dict:
        await asyncio.sleep(max(0.0, arrival - (time.perf_counter() - start)))
        sent = time.perf_counter()
        first, n = None, 0
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter()
            if chunk.usage:
                n = chunk.usage.completion_tokens
        end = time.perf_counter()
        first = first or end
        return {"ttft": first - sent, "tpot": (end - first) / (n - 1) if n > 1 else None, "end": end - start,
                "long": len(prompt), "tokens": n}

    results = await asyncio.gather(*(one(*r) for r in requests))
    await client.close()
    return list(results)


def summary(results: list[dict], ns: argparse.Namespace) -> dict:
    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] * 1e3

    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    met = sum(1 for r in results if r["ttft"] * 1e3 <= ns.ttft_slo_ms
              and (r["tpot"] is None or r["tpot"] * 1e3 <= ns.tpot_slo_ms))
    duration = max(r["end"] for r in results)
    return {"ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99), "tpot_p50_ms": pct(tpot, 0.5),
            "tpot_p99_ms": pct(tpot, 0.99), "goodput_rps": met / duration, "met": met, "duration_s": duration}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workdir", type=Path)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the default model)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--long-fraction", type=float, default=0.2)
    p.add_argument("--long-len", type=int, default=1024)
    p.add_argument("--long-out", type=int, default=8)
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--short-out", type=int, default=32)
    p.add_argument("--ttft-slo-ms", type=float, default=2000)
    p.add_argument("--tpot-slo-ms", type=float, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", type=Path, default=None)
    ns = p.parse_args()
    ns.workdir.mkdir(parents=True, exist_ok=True)
    store = ns.workdir / "store"
    store.mkdir(exist_ok=True)
    model = ns.model or str(ensure_default_model())
    common = ["serve", "--model", model, "--uvicorn-log-level", "warning"]
    connector = ["--kv-connector", "shared-disk", "--kv-connector-options", json.dumps({"path": str(store)})]
    procs = []
    try:
        prefill = start(ns.workdir / "prefill.log", common + ["--cpu-threads", "1", *connector, "--kv-role",
                                                              "prefill"], "0")
        procs.append(prefill[0])
        decode = start(ns.workdir / "decode.log", common + ["--cpu-threads", "1", *connector, "--kv-role", "decode"],
                       "1")
        procs.append(decode[0])
        proxy = start(ns.workdir / "proxy.log", ["kv-proxy", "--prefill", prefill[1], "--decode", decode[1]], "0,1")
        procs.append(proxy[0])
        one = start(ns.workdir / "one.log", common + ["--cpu-threads", "2"], "0,1")
        procs.append(one[0])
        setups = {"split 1+1": proxy[1], "one engine, 2 cores": one[1]}
        for url in setups.values():  # a warm-up of each shape, not timed
            asyncio.run(drive(url, [(0.0, [7] * ns.long_len, 2), (0.0, [9] * ns.short_len, 2)]))
        runs = []
        for r in range(ns.rounds):
            requests = workload(ns, r)
            for name, url in (setups.items() if r % 2 == 0 else reversed(setups.items())):
                load = os.getloadavg()[0]
                result = summary(asyncio.run(drive(url, requests)), ns)
                result.update(setup=name, round=r, load_average=load)
                runs.append(result)
                print(json.dumps(result), flush=True)
        print(f"\nsplit / one engine, per round (load average at each run's start; "
              f"goodput under TTFT <= {ns.ttft_slo_ms:g} ms and TPOT <= {ns.tpot_slo_ms:g} ms):")
        for r in range(ns.rounds):
            split, whole = [next(x for x in runs if x["round"] == r and x["setup"] == name) for name in setups]
            print(f"round {r}: " + ", ".join(f"{k} {split[k] / whole[k]:.2f}x" if whole[k] else f"{k} n/a"
                                           for k in ("ttft_p99_ms", "tpot_p99_ms", "goodput_rps"))
                  + f" (load {split['load_average']:.1f} / {whole['load_average']:.1f})")
        if ns.result_file:
            ns.result_file.write_text(json.dumps({"options": {k: str(v) for k, v in vars(ns).items()},
                                                  "runs": runs}, indent=2) + "\n")
        pairs = [[next(x for x in runs if x["round"] == r and x["setup"] == name) for name in setups]
                 for r in range(ns.rounds)]
        print("median over rounds, split / one engine: " + ", ".join(
            f"{k} {statistics.median(a[k] / b[k] for a, b in pairs if b[k]):.2f}x"
            for k in ("ttft_p99_ms", "tpot_p99_ms", "goodput_rps") if any(b[k] for _, b in pairs)))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
