"""``pagoda bench fairness``: one tenant floods the server while another sends small requests one after another.

For each ``--scheduling-policies`` entry the benchmark builds the engine in this process, serves it on
127.0.0.1 with ``--tenant-source header`` (the real server: uvicorn, streaming, HTTP), and measures the small
tenant's TTFT and TPOT twice: unloaded (alone), then while the flooding tenant's requests (by default those of
the denial-of-service probe: thirteen of ``{"prompt": "x", "n": 8, "max_tokens": 8000, "ignore_eos": true}``)
fill the batch. The flood starts before the small requests, and is cancelled (its streams closed, so the server
aborts it) once they are done. With ``--rounds`` above 1 the policies alternate, round after round, so a busy
machine's noise falls on each of them alike; every round's figures are printed. A policy may carry engine options
of its own (``fair:fair-step-ms=0``), to compare settings of one policy side by side. The flooding tenant's
throughput (its streamed tokens per second) is measured alone, for ``--flood-alone-seconds`` once all its
sequences have started and before the small requests start, and beside them: what a bound on the steps costs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Optional

from pagoda.cli import add_engine_args, engine_args_from
from pagoda.plugins.entrypoints.bench.serve import RequestTiming, bench_session, greedy_body, percentiles, send_one
from pagoda.plugins.entrypoints.bench.workloads import BenchRequest

FLOOD_TENANT, SMALL_TENANT = "flood", "small"
# the small tenant's prompt: a short sentence (its token ids come from the model's tokenizer)
SMALL_PROMPT = "The capital of France is"


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="a flooding tenant beside a small one: the small tenant's TTFT and TPOT unloaded "
                                  "and under each scheduling policy",
                       description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--scheduling-policies", nargs="+", default=["fcfs", "fair"], metavar="POLICY[:OPTION=VALUE]",
                   help="the policies compared, one engine each (default: fcfs fair); engine options of one policy's "
                        "engine follow its name, separated by colons: fair:fair-step-ms=0:fair-step-seqs=4")
    p.add_argument("--flood-alone-seconds", type=float, default=10.0,
                   help="seconds the flooding tenant's throughput is measured alone (once all its sequences have "
                        "started), before the small requests")
    p.add_argument("--flood-requests", type=int, default=13, help="the flooding tenant's concurrent requests")
    p.add_argument("--flood-n", type=int, default=8, help="sequences per flooding request (its n)")
    p.add_argument("--flood-max-tokens", type=int, default=8000, help="max_tokens of a flooding request "
                                                                       "(ignore_eos: it runs until cancelled)")
    p.add_argument("--small-requests", type=int, default=5, help="small requests measured, unloaded and loaded")
    p.add_argument("--small-max-tokens", type=int, default=16, help="output tokens of a small request")
    p.add_argument("--rounds", type=int, default=1, help="rounds over the policies, alternating")
    p.add_argument("--result-file", default=None, help="write every round's per-request timings as JSON")
    add_engine_args(p)
    p.set_defaults(func=run_bench_fairness)


class FairnessServer:
    """One engine under one scheduling policy, served on 127.0.0.1 with tenants from the x-pagoda-tenant header."""

    def __init__(self, ns: argparse.Namespace, policy: str) -> None:
        from pagoda.engine.async_engine import AsyncLLMEngine
        from pagoda.engine.llm import LLM
        from pagoda.plugins.entrypoints.server import ServerThread, build_app

        from pagoda.engine.engine_args import FAIR_FLAGS

        name, options = parse_policy(policy)
        if name != "fair":  # --fair-step-seqs and the like, given for the fair runs, are no options of this policy
            ns = argparse.Namespace(**{**vars(ns), **dict.fromkeys(FAIR_FLAGS)})
        values = engine_args_from(ns, scheduling_policy=name, **options).model_dump(exclude_defaults=True)
        self.policy = policy
        self.llm = LLM(**values, plugin_manager=ns.plugin_manager)
        self.server = ServerThread(build_app(AsyncLLMEngine(self.llm.engine), tenant_source="header")).start()

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def num_unfinished(self) -> int:
        scheduler = self.llm.engine.scheduler
        return scheduler.num_running + scheduler.num_waiting + scheduler.num_swapped

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Until the engine has no request left (the cancelled flood aborted)."""
        deadline = time.monotonic() + timeout
        while self.num_unfinished and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.stop()
        self.llm.engine.shutdown()


def parse_policy(entry: str) -> tuple[str, dict[str, str]]:
    """``POLICY[:OPTION=VALUE...]`` -> the policy's name and its engine options (as EngineArgs field names)."""
    from pagoda.engine.engine_args import EngineArgs
    from pagoda.errors import ConfigError

    name, *pairs = entry.split(":")
    options = {}
    for pair in pairs:
        option, sep, value = pair.partition("=")
        field = option.strip().lstrip("-").replace("-", "_")
        if not sep or field not in EngineArgs.model_fields:
            raise ConfigError(f"--scheduling-policies {entry!r}: {pair!r} is not OPTION=VALUE with an engine option "
                              "(such as fair:fair-step-ms=0)")
        options[field] = value
    return name, options


async def small_requests(url: str, model: str, request: BenchRequest, count: int) -> list[RequestTiming]:
    """``count`` small requests one after another (each sent when the previous one is answered)."""
    async with bench_session({"x-pagoda-tenant": SMALL_TENANT}) as session:
        return [await send_one(session, url + "/v1/completions", greedy_body(model, request), request)
                for _ in range(count)]


class FloodProgress:
    """The flooding requests that have streamed a token, and the tokens (choices of chunks) streamed so far."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.num_started = 0
        self.num_tokens = 0


async def flood_one(session, url: str, model: str, ns: argparse.Namespace, progress: FloodProgress) -> None:
    body = {"model": model, "prompt": "x", "n": ns.flood_n, "max_tokens": ns.flood_max_tokens, "ignore_eos": True,
            "stream": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"a flooding request was refused: HTTP {resp.status}: {(await resp.text())[:300]}")
        counted = False
        async for raw in resp.content:  # one line at a time
            line = raw.decode()
            if not line.startswith("data: {"):
                continue
            progress.num_tokens += len(json.loads(line[6:]).get("choices") or ())
            if not counted:
                counted = True
                progress.num_started += 1
                if progress.num_started == ns.flood_requests:
                    progress.started.set()


async def loaded_run(server: FairnessServer, model: str, request: BenchRequest,
                     ns: argparse.Namespace) -> tuple[list[RequestTiming], int, dict]:
    """The small requests while the flood runs; also the sequences the engine ran when they started, and the
    flood's tokens per second alone (``--flood-alone-seconds`` before them) and beside them."""
    async with bench_session({"x-pagoda-tenant": FLOOD_TENANT}) as session:
        progress = FloodProgress()
        flood = [asyncio.create_task(flood_one(session, server.url, model, ns, progress))
                 for _ in range(ns.flood_requests)]
        waiter = asyncio.create_task(progress.started.wait())
        await asyncio.wait([waiter, *flood], return_when=asyncio.FIRST_COMPLETED)
        for task in flood:
            if task.done() and task.exception() is not None:
                raise task.exception()
        # the flood's throughput alone once every one of its sequences has started (its prompts are not counted)
        scheduler = server.llm.engine.scheduler
        while scheduler.num_waiting:
            await asyncio.sleep(0.05)
        tokens0, t0 = progress.num_tokens, time.perf_counter()
        await asyncio.sleep(ns.flood_alone_seconds)
        tokens1, t1 = progress.num_tokens, time.perf_counter()
        num_running = server.llm.engine.scheduler.num_running
        timings = await small_requests(server.url, model, request, ns.small_requests)
        tokens2, t2 = progress.num_tokens, time.perf_counter()
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    flood_rate = {"alone": (tokens1 - tokens0) / (t1 - t0), "beside_small": (tokens2 - tokens1) / (t2 - t1)}
    return timings, num_running, flood_rate


def summarize(timings: list[RequestTiming]) -> dict:
    """The small tenant's TTFT and TPOT; TTFT also without the first request, which under a flood that ran alone
    until then waits for the rest of one of its steps (a step that has started runs to its end; ``fair`` bounds a
    lone tenant's steps by ``--fair-step-ms``)."""
    ok = [t for t in timings if t.ok]
    errors = sorted({t.error for t in timings if t.error})
    return {"completed": len(ok), "failed": len(timings) - len(ok), "errors": errors[:3],
            "ttft_ms": percentiles([t.ttft for t in ok]),
            "ttft_after_first_ms": percentiles([t.ttft for t in ok[1:]]),
            "tpot_ms": percentiles([t.tpot for t in ok if t.tpot is not None]),
            "ttft_each_ms": [round(t.ttft * 1e3, 1) for t in ok]}


def format_table(rows: list[dict]) -> str:
    """One line per (round, policy, phase): the small tenant's TTFT (all requests, and after the first) and TPOT,
    and their ratio to its unloaded values under the same policy."""
    width = max([8] + [len(row["policy"]) + 2 for row in rows])
    head = (f"{'round':<6}{'policy':<{width}}{'phase':<9}{'seqs':>5}{'TTFT mean':>11}{'p90':>9}{'1st':>8}"
            f"{'2nd+ mean':>11}{'TPOT mean':>11}{'p90':>9}{'TTFT x':>9}{'1st x':>8}{'2nd+ x':>9}{'TPOT x':>9}"
            f"{'flood tok/s alone':>19}{'beside':>8}")
    lines = [head, "-" * len(head)]
    for row in rows:
        ttft, later, tpot, base = row["ttft_ms"], row["ttft_after_first_ms"], row["tpot_ms"], row.get("unloaded")
        first = row["ttft_each_ms"][0] if row["ttft_each_ms"] else float("nan")
        ratios = flood = ""
        if base is not None:
            base_ttft, base_tpot = base["ttft_ms"]["mean"], base["tpot_ms"]["mean"]
            ratios = (f"{ttft['mean'] / base_ttft:>8.1f}x{first / base_ttft:>7.1f}x{later['mean'] / base_ttft:>8.1f}x"
                      f"{tpot['mean'] / base_tpot:>8.1f}x")
        if "flood_tokens_per_s" in row:
            flood = f"{row['flood_tokens_per_s']['alone']:>19.1f}{row['flood_tokens_per_s']['beside_small']:>8.1f}"
        lines.append(f"{row['round']:<6}{row['policy']:<{width}}{row['phase']:<9}{row['num_running']:>5}"
                     f"{ttft['mean']:>9.0f}ms{ttft['p90']:>7.0f}ms{first:>6.0f}ms{later['mean']:>9.0f}ms"
                     f"{tpot['mean']:>9.1f}ms{tpot['p90']:>7.1f}ms" + ratios + flood)
        for err in row["errors"]:
            lines.append(f"  error: {err}")
    return "\n".join(lines)


def small_request(model_dir: Optional[str], output_len: int) -> BenchRequest:
    from pagoda.engine.components import load_tokenizer
    from pagoda.modeling.default_model import resolve_model_path

    tokenizer = load_tokenizer(str(resolve_model_path(model_dir)), None)
    return BenchRequest(tokenizer(SMALL_PROMPT, add_special_tokens=False)["input_ids"], output_len)


def run_bench_fairness(ns: argparse.Namespace) -> int:
    from pagoda.errors import ConfigError

    for flag in ("flood_requests", "flood_n", "flood_max_tokens", "small_requests", "rounds"):
        if getattr(ns, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(ns, flag)}: pass at least 1")
    if not ns.flood_alone_seconds > 0:
        raise ConfigError(f"--flood-alone-seconds {ns.flood_alone_seconds}: pass a time above 0")
    for entry in ns.scheduling_policies:
        parse_policy(entry)
    if ns.small_max_tokens < 2:
        raise ConfigError(f"--small-max-tokens {ns.small_max_tokens}: pass at least 2 (TPOT needs two tokens)")
    request = small_request(ns.model, ns.small_max_tokens)
    print(f"flood: {ns.flood_requests} requests x n={ns.flood_n}, max_tokens {ns.flood_max_tokens}, ignore_eos "
          f"(tenant {FLOOD_TENANT!r}); small: {ns.small_requests} requests one after another, "
          f"{len(request.prompt_token_ids)} prompt + {ns.small_max_tokens} output tokens (tenant {SMALL_TENANT!r})",
          flush=True)
    servers = {}
    rows = []
    try:
        for policy in ns.scheduling_policies:
            servers[policy] = FairnessServer(ns, policy)
        for round_index in range(1, ns.rounds + 1):
            for policy, server in servers.items():
                import httpx

                model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
                asyncio.run(small_requests(server.url, model, request, 1))  # warm-up, not counted
                unloaded = summarize(asyncio.run(small_requests(server.url, model, request, ns.small_requests)))
                unloaded.update(round=round_index, policy=policy, phase="unloaded", num_running=1)
                timings, num_running, flood_rate = asyncio.run(loaded_run(server, model, request, ns))
                loaded = summarize(timings)
                loaded.update(round=round_index, policy=policy, phase="flooded", num_running=num_running,
                              unloaded=unloaded, flood_tokens_per_s=flood_rate)
                server.wait_idle()
                rows += [unloaded, loaded]
                print(format_table([unloaded, loaded]).split("\n", 2)[2], flush=True)
    finally:
        for server in servers.values():
            server.stop()
    print(f"==== pagoda bench fairness: the small tenant's TTFT and TPOT, and their ratio to its unloaded values "
          f"under the same policy ====\n{format_table(rows)}")
    if ns.result_file:
        with open(ns.result_file, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
        print(f"results written to {ns.result_file}")
    return 0 if all(row["failed"] == 0 for row in rows) else 1
