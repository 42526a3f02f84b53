"""pagoda serve against vLLM's server at its best, one server at a time, both driven by vLLM's own serving client.

Usage (vLLM in a venv of its own, as docs/serving_speed.md describes; nothing of it goes into pagoda's):

    python contrib/serving-comparison/compare.py --vllm-venv /path/to/vllm-venv --rates 2 4 8 inf --output table.md
    python contrib/serving-comparison/compare.py --vllm-venv /path/to/vllm-venv --plan   # what it would run

What it does:

1. prints the CPU (model, cores, the instruction-set flags that decide each engine's kernels);
2. round 1: starts ``pagoda serve`` with its defaults, then vLLM's OpenAI server in bfloat16, then in float32, each
   alone on 127.0.0.1; waits until ``/v1/models`` answers, warms each up with 8 requests of prompts no run uses,
   runs vLLM's client once per rate and stops the server before the next starts;
3. takes vLLM's faster dtype (the higher geometric mean of output tok/s over the rates) and says which it was;
   with ``--dtype-check-prompts N`` each dtype runs only N prompts all at once, and vLLM's faster dtype then runs
   every rate after pagoda (for a machine where vLLM's slow dtype would take too long at every rate);
4. rounds 2.. (``--rounds``): that vLLM and pagoda again, the order alternating, so each figure is a median over
   rounds taken in one window;
5. prints a Markdown table of output tok/s, mean and p99 TTFT and mean and p99 TPOT per rate, pagoda's figure
   over vLLM's and who is ahead.

Each run of a round gets prompts of its own (vLLM's random dataset, 128 tokens in, 64 out, no EOS, seed
``--seed`` + the rate's index): a run never finds another run's prompts in a server's prefix cache, and both
engines see the same prompts and arrival times at each rate. The client sends no temperature (vLLM's client's
default): each server samples with its default, temperature 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# vLLM's client, run in the vLLM venv (its `vllm` console script fails on the CPU wheel)
CLIENT = ("import sys, argparse\n"
          "from vllm.benchmarks.serve import add_cli_args, main\n"
          "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n")
# (key in the client's result JSON, label, higher is better)
METRICS = [("output_throughput", "output tok/s", True), ("mean_ttft_ms", "mean TTFT (ms)", False),
           ("p99_ttft_ms", "p99 TTFT (ms)", False), ("mean_tpot_ms", "mean TPOT (ms)", False),
           ("p99_tpot_ms", "p99 TPOT (ms)", False)]
# the flags that decide which kernels each engine runs (bf16 arithmetic above all)
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")
VLLM_DTYPES = ("bfloat16", "float32")
WARMUP_SEED = 1000


@dataclass
class Engine:
    """One server configuration: a name, its command and its environment."""

    tag: str
    command: list[str]
    env: dict[str, str]


def cpu_description(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU model, its logical cores, and which of :data:`ISA_FLAGS` it has (and lacks)."""
    model, flags = "unknown CPU", set()
    try:
        for line in open(cpuinfo):
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    has = [f for f in ISA_FLAGS if f in flags]
    lacks = [f for f in ISA_FLAGS if f not in flags]
    return (f"{model}, {os.cpu_count()} logical cores; flags: {' '.join(has) or 'none of interest'}"
            f"{'; lacks: ' + ' '.join(lacks) if lacks else ''}")


def vllm_env() -> dict[str, str]:
    """This environment, with vLLM's CPU settings defaulted: its OpenMP threads bound to every core and 4 GB of
    KV cache."""
    return dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                                      f"0-{(os.cpu_count() or 1) - 1}"),
                VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))


def engines(args) -> dict[str, Engine]:
    """pagoda with its defaults and vLLM in each dtype."""
    pagoda = Engine("pagoda", [args.pagoda, "serve", "--model", args.model, "--port", str(args.port),
                               *shlex.split(args.pagoda_args)], dict(os.environ))
    out = {"pagoda": pagoda}
    for dtype in args.vllm_dtypes:
        out[f"vllm-{dtype}"] = Engine(f"vllm-{dtype}", [
            args.client_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--dtype", dtype,
            "--max-model-len", "1024", "--port", str(args.port), *shlex.split(args.vllm_args)], vllm_env())
    return out


def client_command(args, model_name: str, rate: str, num_prompts: int, seed: int, result_dir: str,
                   name: str) -> list[str]:
    return [args.client_python, "-c", CLIENT, "--backend", "openai", "--base-url", f"http://127.0.0.1:{args.port}",
            "--endpoint", "/v1/completions", "--model", model_name, "--tokenizer", args.model,
            "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64", "--ignore-eos",
            "--num-prompts", str(num_prompts), "--request-rate", rate, "--seed", str(seed), "--disable-tqdm",
            "--save-result", "--result-dir", result_dir, "--result-filename", name]


def rate_seed(args, rate_index: int) -> int:
    return args.seed + rate_index


def schedule(args) -> list[list[str]]:
    """The engines each round runs, in order: round 1 all three, later rounds the best vLLM (named ``vllm-best``
    until round 1 decides it) and pagoda, the order alternating."""
    if args.dtype_check_prompts:
        rounds = [[*(f"vllm-{d}" for d in args.vllm_dtypes), "pagoda", "vllm-best"]]
    else:
        rounds = [["pagoda", *(f"vllm-{d}" for d in args.vllm_dtypes)]]
    for r in range(1, args.rounds):
        rounds.append(["vllm-best", "pagoda"] if r % 2 else ["pagoda", "vllm-best"])
    return rounds


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as resp:
                return json.load(resp)["data"][0]["id"]
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server did not answer /v1/models within {timeout:.0f} s")


def run_client(args, model_name: str, rate: str, num_prompts: int, seed: int, result_dir: str, name: str) -> dict:
    cmd = client_command(args, model_name, rate, num_prompts, seed, result_dir, name)
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's client failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(Path(result_dir, name).read_text())


def bench_engine(engine: Engine, args, result_dir: str, round_no: int, rates: Optional[list[str]] = None,
                 num_prompts: Optional[int] = None) -> dict[str, dict]:
    """Start the server, warm it up, run the client at every rate (``rates``, default ``--rates``), stop it; the
    client's results by rate."""
    rates = args.rates if rates is None else rates
    print(f"== round {round_no}, {engine.tag}: {shlex.join(engine.command)}", flush=True)
    log = open(Path(result_dir, f"{engine.tag}-{round_no}-server.log"), "w")
    proc = subprocess.Popen(engine.command, env=engine.env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        model_name = wait_ready(args.port, proc, args.start_timeout)
        run_client(args, model_name, "inf", 8, WARMUP_SEED + round_no, result_dir, f"{engine.tag}-{round_no}-warmup")
        results = {}
        for i, rate in enumerate(rates):
            r = run_client(args, model_name, rate, num_prompts or args.num_prompts, rate_seed(args, i), result_dir,
                           f"{engine.tag}-{round_no}-{rate}.json")
            results[rate] = r
            print(f"   rate {rate}: {r['output_throughput']:.1f} output tok/s, TTFT mean {r['mean_ttft_ms']:.0f} "
                  f"p99 {r['p99_ttft_ms']:.0f} ms, TPOT mean {r['mean_tpot_ms']:.1f} p99 {r['p99_tpot_ms']:.1f} ms",
                  flush=True)
        return results
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def geomean_throughput(results: dict[str, dict]) -> float:
    values = [r["output_throughput"] for r in results.values()]
    return math.exp(sum(math.log(max(v, 1e-9)) for v in values) / len(values)) if values else 0.0


def best_dtype(by_dtype: dict[str, dict[str, dict]]) -> str:
    """vLLM's faster dtype: the higher geometric mean of output tok/s over the rates."""
    return max(by_dtype, key=lambda d: geomean_throughput(by_dtype[d]))


def pick_dtype(by_dtype: dict[str, dict[str, dict]]) -> str:
    """:func:`best_dtype`, said aloud; an error when no dtype ran."""
    if not by_dtype:
        raise RuntimeError("vLLM's server failed in every dtype (see above; --keep keeps its logs)")
    best = best_dtype(by_dtype)
    print(f"vLLM is faster in {best} on this CPU: geometric mean output tok/s "
          + ", ".join(f"{d} {geomean_throughput(r):.1f}" for d, r in by_dtype.items()), flush=True)
    return best


def medians(rounds: list[dict[str, dict]], rates: list[str]) -> dict[str, dict]:
    """Per rate, each metric's median over the rounds."""
    out = {}
    for rate in rates:
        out[rate] = {}
        for key, _, _ in METRICS:
            values = sorted(r[rate][key] for r in rounds)
            mid = len(values) // 2
            out[rate][key] = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return out


def table(pagoda: dict[str, dict], vllm: dict[str, dict], rates: list[str]) -> str:
    lines = ["| rate (req/s) | metric | pagoda | vLLM | pagoda / vLLM | pagoda ahead |", "|---|---|---|---|---|---|"]
    for rate in rates:
        for key, label, higher_better in METRICS:
            a, b = pagoda[rate][key], vllm[rate][key]
            ratio = a / b if b else float("nan")
            ahead = a > b if higher_better else a < b
            lines.append(f"| {rate} | {label} | {a:.1f} | {b:.1f} | {ratio:.2f}x | {'yes' if ahead else 'no'} |")
    return "\n".join(lines)


def report(cpu: str, args, dtype_figures: dict[str, float], best: str, pagoda: dict, vllm: dict,
           num_rounds: int) -> str:
    tried = ", ".join(f"{d} {v:.1f}" for d, v in dtype_figures.items())
    if args.dtype_check_prompts:
        tried += f" with {args.dtype_check_prompts} prompts all at once"
    chosen = (f"its faster dtype here: geometric mean of output tok/s over the rates, {tried}"
              if len(dtype_figures) > 1 else f"the only dtype run (--vllm-dtypes): {tried}")
    return (f"CPU: {cpu}\n"
            f"model {Path(args.model).name}; pagoda with its defaults; vLLM in {best} ({chosen}); vLLM's client for both, random 128 in / "
            f"64 out, {args.num_prompts} prompts per run, seeds {args.seed}..{args.seed + len(args.rates) - 1} by "
            f"rate; {'median of ' + str(num_rounds) + ' alternated rounds' if num_rounds > 1 else 'one round'}\n\n"
            + table(pagoda, vllm, args.rates))


def print_plan(args, cpu: str) -> None:
    """What a run would do, without starting anything."""
    print(f"CPU: {cpu}")
    all_engines = engines(args)
    for round_no, tags in enumerate(schedule(args), start=1):
        for tag in tags:
            if tag == "vllm-best":
                print(f"round {round_no}: vLLM in the dtype round 1 found faster ({' or '.join(args.vllm_dtypes)})")
                continue
            e = all_engines[tag]
            env = {k: e.env[k] for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE") if k in e.env}
            env_text = " ".join(f"{k}={v}" for k, v in env.items())
            check = (f" (dtype check: {args.dtype_check_prompts} prompts all at once)"
                     if args.dtype_check_prompts and tag.startswith("vllm-") else "")
            print(f"round {round_no}: {tag}: {env_text + ' ' if env_text else ''}{shlex.join(e.command)}{check}")
    print(f"per server: warm-up of 8 requests at once (seed {WARMUP_SEED} + round), then per rate:")
    for i, rate in enumerate(args.rates):
        cmd = client_command(args, "<served model name>", rate, args.num_prompts, rate_seed(args, i), "<results>",
                             f"<engine>-{rate}.json")
        cmd[2] = "<vllm.benchmarks.serve's main>"
        print("  " + shlex.join(cmd))


def parse_args(argv: Optional[list[str]] = None):
    here = Path(sys.executable).parent
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-venv", required=True, help="the venv holding vllm-cpu (its bin/python runs the client "
                                                       "and vLLM's server)")
    p.add_argument("--pagoda", default=str(here / "pagoda"), help="the pagoda command (default: beside this python)")
    p.add_argument("--model", default=None, help="the checkpoint directory both servers load (default: the "
                                                 "default model's directory)")
    p.add_argument("--rates", nargs="+", default=["2", "4", "8", "inf"])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--seed", type=int, default=0, help="the first rate's seed; rate i uses seed + i")
    p.add_argument("--rounds", type=int, default=1, help="rounds in all: round 1 picks vLLM's dtype, the others "
                                                         "alternate that vLLM and pagoda; figures are medians")
    p.add_argument("--vllm-dtypes", nargs="+", choices=VLLM_DTYPES, default=list(VLLM_DTYPES),
                   help="the dtypes vLLM runs in (default: both; one alone skips the check of which is faster, and "
                        "the report says vLLM ran only in it)")
    p.add_argument("--dtype-check-prompts", type=int, default=0, metavar="N",
                   help="pick vLLM's dtype from N prompts all at once per dtype, then run only the faster at every "
                        "rate (default 0: every dtype at every rate)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--pagoda-args", default="", help="extra flags for pagoda serve, one string")
    p.add_argument("--vllm-args", default="", help="extra flags for vLLM's server (both dtypes), one string")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--output", default=None, help="also write the report (Markdown) here")
    p.add_argument("--keep", action="store_true", help="keep the client's JSON results and the server logs")
    p.add_argument("--plan", action="store_true", help="print the CPU and every command a run would start, run "
                                                       "nothing")
    args = p.parse_args(argv)
    for rate in args.rates:
        try:
            if not float(rate) > 0:
                raise ValueError
        except ValueError:
            p.error(f"--rates: {rate!r} is not a rate in requests/s > 0 (or 'inf')")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.dtype_check_prompts < 0:
        p.error("--dtype-check-prompts must be 0 (off) or more")
    if args.num_prompts < 1:
        p.error("--num-prompts must be at least 1")
    args.client_python = str(Path(args.vllm_venv, "bin", "python"))
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from pagoda.modeling.default_model import resolve_model_path

        args.model = str(resolve_model_path(None))
    cpu = cpu_description()
    if args.plan:
        print_plan(args, cpu)
        return 0
    if not Path(args.client_python).exists():
        print(f"compare.py: error: {args.client_python} does not exist; give --vllm-venv the venv vllm-cpu is "
              "installed in", file=sys.stderr)
        return 2
    print(f"CPU: {cpu}", flush=True)
    all_engines = engines(args)
    result_dir = tempfile.mkdtemp(prefix="pagoda-vs-vllm-")
    pagoda_rounds: list[dict] = []
    vllm_rounds: list[dict] = []
    try:
        by_dtype: dict[str, dict] = {}
        for round_no, tags in enumerate(schedule(args), start=1):
            for tag in tags:
                if tag == "vllm-best" and round_no == 1:  # after a dtype check: the faster dtype at every rate
                    best = pick_dtype(by_dtype)
                    vllm_rounds.append(bench_engine(all_engines[f"vllm-{best}"], args, result_dir, round_no))
                elif tag == "vllm-best":
                    vllm_rounds.append(bench_engine(all_engines[f"vllm-{best}"], args, result_dir, round_no))
                elif tag == "pagoda":
                    pagoda_rounds.append(bench_engine(all_engines[tag], args, result_dir, round_no))
                else:
                    check = ["inf"] if args.dtype_check_prompts else None
                    try:
                        by_dtype[tag[len("vllm-"):]] = bench_engine(all_engines[tag], args, result_dir, round_no,
                                                                    check, args.dtype_check_prompts or None)
                    except RuntimeError as exc:  # the other dtype may still run: say why this one did not
                        print(f"   {tag} failed, left out: {exc}", flush=True)
            if round_no == 1 and not args.dtype_check_prompts:
                best = pick_dtype(by_dtype)
                vllm_rounds.append(by_dtype[best])
    finally:
        if args.keep:
            print(f"results and server logs kept in {result_dir}")
        else:
            shutil.rmtree(result_dir, ignore_errors=True)
    out = report(cpu, args, {d: geomean_throughput(r) for d, r in by_dtype.items()}, best,
                 medians(pagoda_rounds, args.rates), medians(vllm_rounds, args.rates), args.rounds)
    print(out)
    if args.output:
        Path(args.output).write_text(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
