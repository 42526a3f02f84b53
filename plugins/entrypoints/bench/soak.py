"""``pagoda bench soak``: the server's resident memory through hostile load, with the allocator tuned and not.

For each ``--malloc-tuning`` mode (default: ``on off``) the soak starts ``pagoda serve`` as a child process on a
free port of 127.0.0.1 (so the client's own memory is not counted), then runs phases and records the server's
resident set size (VmRSS of it and its child processes, read from /proc once it is idle again) after each:

1. ``warm-up``: ``--warmup-requests`` ordinary requests (completions and chat, streamed and not, one with a JSON
   schema), so the caches a served model needs are filled: the baseline;
2. ``fuzzing``: schemathesis generates requests from the server's OpenAPI document (``--fuzz-max-examples`` per
   operation; needs schemathesis, in pagoda's ``test`` extra);
3. ``storm 1`` .. ``storm N``: ``--storm-requests`` streamed completions, ``--storm-concurrency`` at a time,
   each cut after its first few tokens (the client closes the connection; the server aborts the request);
4. ``hostile``: ``--hostile-rounds`` rounds of what one client may try against the others: expensive JSON schemas
   abandoned after a second, then another key's tiny schema (its wait recorded); self-referencing and remote
   ``$ref`` schemas; one key storing responses past its quota while another's stays readable (and a 404 to the
   flooder); adapter loads with a 1 MiB name and paths outside the adapter roots. Any 5xx is counted.

Idle means the server's /metrics show no running or waiting request and no KV block in use. The report gives each
phase's RSS and its growth over the warm-up; the soak passes when the end is within ``--max-growth`` of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time

# what a served engine runs with in the soak unless --serve-args says otherwise: one thread (the machine is shared),
# a short context so fuzzed requests end quickly
DEFAULT_SERVE_ARGS = "--cpu-threads 1 --max-model-len 256 --max-waiting-requests 64"
# schemathesis' checks: no 5xx, and every answer as the document says
FUZZ_CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance"
# operations whose fuzzed cases mostly get a 400 for rules a schema cannot state (see tests/test_server_openapi.py)
FUZZ_QUIET_PATHS = ("/v1/responses/{response_id}", "/v1/chat/completions", "/tokenize")


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="the server's resident memory after warm-up, schema fuzzing and disconnect storms",
                       description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--malloc-tuning", nargs="+", default=["on", "off"], choices=["on", "off"], dest="malloc_modes",
                   help="soak a server with the allocator tuned (--malloc-tuning) and/or not (--no-malloc-tuning)")
    p.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS,
                   help="options of the `pagoda serve` soaked, one string (default: %(default)r)")
    p.add_argument("--warmup-requests", type=int, default=24, help="ordinary requests before the baseline")
    p.add_argument("--fuzz-max-examples", type=int, default=20,
                   help="schemathesis cases per operation (0: no fuzzing)")
    p.add_argument("--storms", type=int, default=2, help="disconnect storms after the fuzzing")
    p.add_argument("--storm-requests", type=int, default=300, help="streamed requests cut mid-stream per storm")
    p.add_argument("--storm-concurrency", type=int, default=48, help="storm requests open at once")
    p.add_argument("--hostile-rounds", type=int, default=1,
                   help="rounds of the hostile phase (structured outputs, stored responses, adapters; 0: none)")
    p.add_argument("--max-growth", type=float, default=0.10,
                   help="the RSS growth over the warm-up the soak accepts at its end (default 0.10: 10%%)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds the server may take to start")
    p.add_argument("--result-file", default=None, help="write every mode's phases and RSS as JSON")
    p.set_defaults(func=run_bench_soak)


# ---- the server ------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` and its descendants (VmRSS from /proc; 0 for one gone)."""
    total = 0
    pending = [pid]
    while pending:
        p = pending.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    pending.extend(int(c) for c in f.read().split())
        except (OSError, StopIteration):
            continue
    return total


class SoakServer:
    """``pagoda serve`` in a child process, with its own options; its log goes to a temporary file."""

    def __init__(self, serve_args: list[str], malloc_tuning: bool) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagoda-soak-", suffix=".log", delete=False)
        argv = [sys.executable, "-c", "import sys; from pagoda.cli import main; sys.exit(main())", "serve",
                "--port", str(self.port), "--uvicorn-log-level", "warning", *serve_args,
                "--malloc-tuning" if malloc_tuning else "--no-malloc-tuning"]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        from pagoda.errors import ConfigError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError(f"`pagoda serve` exited with {self.proc.returncode} before it served; its log:\n"
                                  f"{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ConfigError(f"`pagoda serve` did not answer /health within {timeout:.0f} s (--start-timeout); its log:\n"
                          f"{self.tail()}")

    def tail(self, num_chars: int = 3000) -> str:
        with open(self.log.name) as f:
            return f.read()[-num_chars:]

    def load(self) -> dict[str, float]:
        """The server's running and waiting requests and KV use, from /metrics."""
        import httpx

        values = {}
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
                if line.startswith(f"pagoda:{name}"):
                    values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return values

    def wait_idle(self, timeout: float = 120.0) -> dict[str, float]:
        """Until no request runs or waits and no KV block is in use (or ``timeout``); the last load read."""
        deadline = time.monotonic() + timeout
        load = self.load()
        while any(load.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
            load = self.load()
        time.sleep(1.0)  # the last answers' buffers are released
        return load

    @property
    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


# ---- the phases ------------------------------------------------------------------------------------------------


def warm_up(url: str, model: str, count: int) -> None:
    """Ordinary requests of every kind the fuzzing and the storms send: completions and chat, streamed and not,
    and one with a JSON schema (its grammar compiled once)."""
    import httpx

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    bodies = [
        ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8}),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 8,
                                  "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "A city, as JSON."}], "max_tokens": 16,
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "city", "schema": schema}}}),
    ]
    with httpx.Client(timeout=300) as client:
        for i in range(count):
            path, body = bodies[i % len(bodies)]
            resp = client.post(url + path, json={"model": model, **body})
            resp.raise_for_status()


def fuzz(url: str, max_examples: int, workdir: str) -> tuple[int, str]:
    """schemathesis over the server's OpenAPI document; its exit code and the end of its report."""
    from pagoda.errors import ConfigError

    try:
        import schemathesis  # noqa: F401
    except ImportError:
        raise ConfigError("the soak's fuzzing needs schemathesis: pip install 'pagoda[test]' (or schemathesis), or "
                          "pass --fuzz-max-examples 0 to soak without it") from None
    config = os.path.join(workdir, "schemathesis.toml")
    with open(config, "w") as f:
        f.write("".join(f'[[operations]]\ninclude-path = "{path}"\nwarnings = false\n\n' for path in FUZZ_QUIET_PATHS))
    argv = [sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
            "--config-file", config, "run", url + "/openapi.json", "--phases", "fuzzing", "--max-examples",
            str(max_examples), "--seed", "1", "--checks", FUZZ_CHECKS, "--request-timeout", "120", "--no-color"]
    run = subprocess.run(argv, capture_output=True, text=True, cwd=workdir)
    return run.returncode, (run.stdout + run.stderr)[-1500:]


async def storm(url: str, model: str, num_requests: int, concurrency: int) -> dict[str, int]:
    """``num_requests`` streamed completions, ``concurrency`` open at once, each closed by the client after its
    first one to four chunks. Returns how many were cut mid-stream and how many were refused or failed."""
    import httpx

    counts = {"cut": 0, "refused": 0, "failed": 0}
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)

    async def one(client, i: int) -> None:
        body = {"model": model, "prompt": f"Story number {i}:", "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        async with gate:
            try:
                async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        counts["refused"] += 1
                        return
                    chunks = 0
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            chunks += 1
                            if chunks > i % 4:
                                counts["cut"] += 1
                                return  # leaving the block closes the connection mid-stream
            except httpx.HTTPError:
                counts["failed"] += 1

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        await asyncio.gather(*(one(client, i) for i in range(num_requests)))
    return counts


def hostile(url: str, model: str) -> dict[str, float]:
    """One round of the hostile phase; the tiny schema's wait in seconds, the responses that went missing and
    the number of 5xx answers."""
    import httpx

    def chat(schema: dict, key: str, timeout: float = 300) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout,
                          headers={"authorization": f"Bearer {key}"})

    statuses = []
    for tag in "abc":
        names = [f"{tag}{i}" for i in range(1000)]
        schema = {"type": "object", "properties": {n: {"type": "string", "pattern": "[a-z]{1,50}"} for n in names},
                  "required": names}
        try:
            statuses.append(chat(schema, "hostile", timeout=1.0).status_code)
        except httpx.TimeoutException:
            pass
    start = time.monotonic()
    statuses.append(chat({"type": "object", "properties": {"n": {"type": "integer"}}}, "polite").status_code)
    tiny_seconds = time.monotonic() - start
    for schema in ({"$ref": "#"}, {"$ref": "http://example.com/s.json"}, {"type": "string", "minLength": 10 ** 9}):
        statuses.append(chat(schema, "hostile").status_code)

    def respond(key: str) -> httpx.Response:
        return httpx.post(url + "/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 1},
                          headers={"authorization": f"Bearer {key}"}, timeout=300)

    kept = respond("polite")
    statuses.append(kept.status_code)
    for _ in range(8):
        statuses.append(respond("hostile").status_code)
    kept_id = kept.json().get("id", "")
    statuses.append(httpx.get(url + f"/v1/responses/{kept_id}", headers={"authorization": "Bearer hostile"},
                              timeout=60).status_code)
    found = httpx.get(url + f"/v1/responses/{kept_id}", headers={"authorization": "Bearer polite"}, timeout=60)
    for body in ({"lora_name": "n" * (1 << 20), "lora_path": "/tmp"}, {"lora_name": "x", "lora_path": "/etc"},
                 {"lora_name": "x", "lora_path": "/proc/self"}):
        statuses.append(httpx.post(url + "/v1/load_lora_adapter", json=body, timeout=60).status_code)
    return {"tiny_schema_s": round(tiny_seconds, 2), "responses_lost": int(found.status_code != 200),
            "server_errors": sum(code >= 500 for code in statuses)}


def soak_one(ns: argparse.Namespace, malloc_tuning: bool) -> dict:
    """One server through every phase; its RSS after each, in bytes."""
    import httpx

    mode = "on" if malloc_tuning else "off"
    server = SoakServer(shlex.split(ns.serve_args), malloc_tuning)
    phases: list[dict] = []

    def record(phase: str, **extra) -> None:
        load = server.wait_idle()
        phases.append({"phase": phase, "rss": server.rss, "load": load, **extra})
        print(f"malloc tuning {mode:<4}{phase:<12}{phases[-1]['rss'] / 2 ** 20:>9.1f} MB  "
              + " ".join(f"{k}={v}" for k, v in extra.items()), flush=True)

    try:
        server.wait_ready(ns.start_timeout)
        record("started")
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        warm_up(server.url, model, ns.warmup_requests)
        record("warm-up")
        if ns.fuzz_max_examples:
            with tempfile.TemporaryDirectory() as workdir:
                code, report = fuzz(server.url, ns.fuzz_max_examples, workdir)
            record("fuzzing", schemathesis_exit=code)
            if code != 0:
                print(f"schemathesis found problems (exit {code}):\n{report}", flush=True)
        for k in range(1, ns.storms + 1):
            counts = asyncio.run(storm(server.url, model, ns.storm_requests, ns.storm_concurrency))
            record(f"storm {k}", **counts)
        for k in range(1, ns.hostile_rounds + 1):
            record(f"hostile {k}", **hostile(server.url, model))
        alive = server.proc.poll() is None
    finally:
        server.stop()
    base = next(p["rss"] for p in phases if p["phase"] == "warm-up")
    for p in phases:
        p["growth"] = p["rss"] / base - 1
    return {"malloc_tuning": mode, "phases": phases, "alive": alive}


def format_table(runs: list[dict]) -> str:
    head = f"{'malloc tuning':<15}{'phase':<12}{'RSS MB':>10}{'vs warm-up':>12}"
    lines = [head, "-" * len(head)]
    for run in runs:
        for p in run["phases"]:
            lines.append(f"{run['malloc_tuning']:<15}{p['phase']:<12}{p['rss'] / 2 ** 20:>10.1f}"
                         f"{p['growth'] * 100:>+11.1f}%")
    return "\n".join(lines)


def run_bench_soak(ns: argparse.Namespace) -> int:
    from pagoda.errors import ConfigError

    for flag in ("warmup_requests", "storm_requests", "storm_concurrency"):
        if getattr(ns, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(ns, flag)}: pass at least 1")
    for flag in ("fuzz_max_examples", "storms", "hostile_rounds"):
        if getattr(ns, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(ns, flag)}: pass 0 or more")
    if not ns.max_growth > 0:
        raise ConfigError(f"--max-growth {ns.max_growth}: pass a fraction above 0, such as 0.1 for 10%")
    if not sys.platform.startswith("linux"):
        raise ConfigError("pagoda bench soak reads resident memory from /proc: run it on Linux")
    runs = [soak_one(ns, mode == "on") for mode in dict.fromkeys(ns.malloc_modes)]
    print(f"==== pagoda bench soak: the server's resident memory after each phase ({ns.serve_args}) ====\n"
          f"{format_table(runs)}")
    ok = True
    for run in runs:
        end = run["phases"][-1]
        within = end["growth"] <= ns.max_growth
        ok &= within and run["alive"]
        print(f"malloc tuning {run['malloc_tuning']}: the end is {end['growth'] * 100:+.1f}% over the warm-up "
              f"({'within' if within else 'over'} {ns.max_growth * 100:.0f}%)")
    if ns.result_file:
        with open(ns.result_file, "w") as f:
            json.dump({"serve_args": ns.serve_args, "runs": runs}, f, indent=2)
        print(f"results written to {ns.result_file}")
    return 0 if ok else 1
