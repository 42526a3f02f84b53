"""pagoda, vLLM-CPU and HF transformers on one random-weight MoE of a realistic shape, one engine at a time.

    python contrib/moe-bench/compare_moe.py --vllm-venv /path/to/vllm-venv               # 4 layers
    python contrib/moe-bench/compare_moe.py --vllm-venv /path/to/vllm-venv --layers 24   # the full shape
    python contrib/moe-bench/compare_moe.py --quick --no-vllm                            # a smoke run

What it does:

1. prints the CPU (model, cores, the instruction-set flags that decide each engine's kernels), the load average,
   and the memory bandwidth measured on the spot (the best of five sums and copies of a 256 MB buffer on every
   core; the roofline takes the higher);
2. writes the checkpoint with make_random_moe.py (hidden 1024, 64 experts of 512, 8 active; ``--layers``) unless
   ``--checkpoint-dir`` holds it already, in bf16, and in float32 (the same weights, cast) when an engine runs in
   float32; prints the bytes a decode token reads at batch 1 (the 8 active experts' weights, the attention's,
   the router's and the LM head's) and the roofline's time per token at the measured bandwidth;
3. runs, each in a fresh process, one after another: pagoda with its defaults (bf16; ``--pagoda-float32``
   adds a float32 run), vLLM in bf16 and in float32 (``--vllm-dtypes``; its faster figure is the one compared),
   HF transformers at batch 1 in bf16 and float32 (``--hf-dtypes``; the faster compared);
4. prints one Markdown table: output tok/s on the first 16 W1 requests of ``pagoda bench throughput``
   (the same token ids for every engine, ``ignore_eos``, each to its output length), and ms per output token
   at batch 1, (time of 17 tokens - time of 1 token) / 16 on a 32-token prompt, the median of 3; then pagoda's
   figures over vLLM's and transformers'.

``--quick``: 2 layers, 4 requests of 8 output tokens, batch 1 over 8 tokens, one repeat.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
DTYPES = ("bfloat16", "float32")
BYTES_PER_WEIGHT = {"bfloat16": 2, "float32": 4}
PROMPT_LEN = 32  # batch 1's prompt


def _load_script(name: str, path: Optional[Path] = None):
    """A contrib script (``HERE/name.py`` unless ``path``) as a module; its ``main`` does not run."""
    spec = importlib.util.spec_from_file_location(name, path or HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclass
class Run:
    """One engine in one dtype: its figures, or why it has none."""

    engine: str
    dtype: str
    output_tok_s: Optional[float] = None
    ms_per_token: Optional[float] = None
    load_seconds: Optional[float] = None
    error: Optional[str] = None
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.engine}, {self.dtype}"


def memory_bandwidth_gbps(num_bytes: int = 1 << 28, threads: Optional[int] = None) -> tuple[float, float]:
    """(read, copy) GB/s, each the best of five passes over a ``num_bytes`` buffer: a sum reads it; a copy reads it
    and writes another (counted as 2 x ``num_bytes``; the cache lines written are read first too, so a copy
    understates what a stream of reads, as a decode step's weights are, can take)."""
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    read = copy = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        src.sum()
        read = min(read, time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        copy = min(copy, time.perf_counter() - start)
    return num_bytes / read / 1e9, 2 * num_bytes / copy / 1e9


def num_experts(config: dict) -> int:
    """The experts per layer (``num_local_experts`` as transformers 5 writes it, ``num_experts`` before)."""
    return config.get("num_local_experts") or config["num_experts"]


def decode_bytes(config: dict, bytes_per_weight: int) -> tuple[int, int]:
    """Bytes of weights one decode token reads at batch 1: (the active experts', everything else's: attention,
    router, norms, the embedding row and the LM head)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    q_width = config["num_attention_heads"] * config["head_dim"]
    kv_width = config["num_key_value_heads"] * config["head_dim"]
    experts = layers * config["num_experts_per_tok"] * 3 * hidden * config["moe_intermediate_size"]
    attention = hidden * q_width * 2 + hidden * kv_width * 2 + 2 * config["head_dim"]  # q, o; k, v; q/k norms
    router_and_norms = hidden * num_experts(config) + 2 * hidden
    dense = layers * (attention + router_and_norms) + hidden + config["vocab_size"] * hidden + hidden
    return experts * bytes_per_weight, dense * bytes_per_weight


def checkpoint(root: Path, layers: int, dtype: str) -> Path:
    """The random checkpoint of ``layers`` layers in ``dtype`` under ``root``, written unless there already; the
    float32 one is the bf16 one cast, so every engine computes with the same weights."""
    out = root / f"moe{layers}-{dtype}"
    if (out / "config.json").exists():
        return out
    partial = root / f".moe{layers}-{dtype}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    if dtype == "bfloat16":
        _load_script("make_random_moe").write_random_moe(partial, layers)
    else:
        _cast_checkpoint(checkpoint(root, layers, "bfloat16"), partial, dtype)
    partial.rename(out)
    return out


def _cast_checkpoint(src: Path, dst: Path, dtype: str) -> None:
    """``src`` (make_random_moe.py's one safetensors file and its config) with its weights cast to ``dtype``."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.suffix == ".safetensors":
            tensors = {name: t.to(getattr(torch, dtype)) if t.is_floating_point() else t
                       for name, t in load_file(path).items()}
            save_file(tensors, dst / path.name, metadata={"format": "pt"})
        elif path.name == "config.json":
            config = json.loads(path.read_text())
            config["dtype"] = dtype
            (dst / path.name).write_text(json.dumps(config, indent=2))
        elif path.is_file():
            shutil.copy(path, dst / path.name)


def workloads(model_dir: Path, num_requests: int, max_output: Optional[int], batch1_tokens: int):
    """The first ``num_requests`` W1 requests of ``pagoda bench throughput`` (output lengths capped at
    ``max_output``) and batch 1's prompt, drawn with this checkpoint's vocabulary and special tokens."""
    from transformers import AutoTokenizer

    from pagoda.plugins.entrypoints.bench.workloads import latency_1, random_64

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    special = set(AutoTokenizer.from_pretrained(str(model_dir)).all_special_ids)
    requests = [[r.prompt_token_ids, min(r.output_len, max_output or r.output_len)]
                for r in random_64(vocab, special, num_requests)]
    return requests, latency_1(vocab, special, PROMPT_LEN, batch1_tokens).prompt_token_ids


def run_engine(python: str, job: dict, env: dict, log_dir: Path, tag: str, timeout: float) -> dict:
    """run_engine.py in a fresh process of ``python``; its result, or RuntimeError with its log's tail."""
    job = dict(job, result=str(log_dir / f"{tag}.json"))
    log_path = log_dir / f"{tag}.log"
    with open(log_path, "w") as log:
        try:
            done = subprocess.run([python, str(HERE / "run_engine.py")], input=json.dumps(job), text=True,
                                  stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"did not finish within {timeout:.0f} s (--timeout)") from None
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}:\n{log_path.read_text()[-2000:]}")
    return json.loads(Path(job["result"]).read_text())


def run_hf(model_dir: Path, dtype: str, threads: int, prompt: list[int], batch1_tokens: int, repeats: int,
           timeout: float) -> float:
    """HF transformers' seconds per output token at batch 1, by pagoda bench's baseline script in a fresh process:
    (time of batch1_tokens + 1 tokens - time of 1 token) / batch1_tokens, the median over ``repeats``."""
    from pagoda.plugins.entrypoints.bench import hf_baseline

    job = {"kind": "latency", "model": str(model_dir), "dtype": dtype, "threads": threads,
           "requests": [[prompt, batch1_tokens + 1]], "repeats": repeats}
    done = subprocess.run([sys.executable, hf_baseline.__file__], input=json.dumps(job), capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)["tpot"]


def _ratio_cell(pagoda: Run, peers: list[Run], attr: str, higher_is_better: bool, unit: str) -> str:
    """pagoda's ``attr`` over the best peer's, and who is ahead; "-" when either has none."""
    ran = [r for r in peers if getattr(r, attr)]
    if not ran or not getattr(pagoda, attr):
        return "-"
    best = (max if higher_is_better else min)(ran, key=lambda r: getattr(r, attr))
    x = getattr(pagoda, attr) / getattr(best, attr)
    ahead = x > 1 if higher_is_better else x < 1
    return f"{x:.2f}x {unit} {best.dtype}'s ({'ahead' if ahead else 'behind'})"


def ratio_rows(pagoda: Run, peers: list[Run], name: str) -> list[str]:
    """pagoda's figures over the peer's better figure in each workload (no row when the peer has none)."""
    if not peers:
        return []
    return [f"| pagoda {pagoda.dtype} / {name} | {_ratio_cell(pagoda, peers, 'output_tok_s', True, 'of')} | "
            f"{_ratio_cell(pagoda, peers, 'ms_per_token', False, 'the time of')} | |"]


def table(runs: list[Run], num_requests: int, batch1_tokens: int, roofline_ms: dict[str, float]) -> str:
    lines = [f"| engine | {num_requests} W1 requests: output tok/s | batch 1: ms per output token | start-up |",
             "|---|---|---|---|"]
    for r in runs:
        if r.error:
            lines.append(f"| {r.label} | failed | failed | |")
            continue
        tok_s = f"{r.output_tok_s:.1f}" if r.output_tok_s else "not run"
        start = f"{r.load_seconds:.1f} s" if r.load_seconds is not None else ""
        lines.append(f"| {r.label} | {tok_s} | {r.ms_per_token:.1f} | {start} |")
    for dtype, ms in roofline_ms.items():
        lines.append(f"| memory-bandwidth roofline, {dtype} weights | | {ms:.1f} | |")
    pagoda = next((r for r in runs if r.engine == "pagoda" and not r.error), None)
    if pagoda is not None:
        lines += ratio_rows(pagoda, [r for r in runs if r.engine == "vLLM" and not r.error], "best vLLM")
        lines += ratio_rows(pagoda, [r for r in runs if r.engine == "transformers" and not r.error], "transformers")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the checkpoint (24: the full shape, "
                                                         "4.8 GB in bf16)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path(tempfile.gettempdir()) / "pagoda-moe-bench",
                   help="where the checkpoints are written, and reused by later runs")
    p.add_argument("--pagoda-float32", action="store_true", help="also run pagoda in float32")
    p.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV"),
                   help="the venv holding vllm-cpu (default: $VLLM_VENV)")
    p.add_argument("--vllm-dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    p.add_argument("--hf-dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--no-hf", action="store_true", help="leave HF transformers out")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one engine's run may take")
    p.add_argument("--quick", action="store_true", help="2 layers, 4 requests of 8 tokens, batch 1 over 8 tokens, "
                                                        "one repeat: a smoke run")
    p.add_argument("--output", type=Path, default=None, help="also write the report (Markdown) here")
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error("--layers must be at least 1")
    if not args.no_vllm:
        if args.vllm_venv is None:
            p.error("vLLM needs --vllm-venv (the venv vllm-cpu is installed in), or pass --no-vllm")
        if not Path(args.vllm_venv, "bin", "python").exists():
            p.error(f"--vllm-venv {args.vllm_venv}: there is no bin/python in it; give the venv vllm-cpu is "
                    "installed in, or pass --no-vllm")
    if args.quick:
        args.layers, args.num_requests, args.max_output, args.batch1_tokens, args.repeats = 2, 4, 8, 8, 1
    else:
        args.num_requests, args.max_output, args.batch1_tokens, args.repeats = 16, None, 16, 3
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    # contrib/serving-comparison/compare.py: its CPU description and vLLM's environment
    serving_compare = _load_script("serving_compare", HERE.parent / "serving-comparison" / "compare.py")
    cpu = serving_compare.cpu_description()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    read_gbps, copy_gbps = memory_bandwidth_gbps()
    bandwidth = max(read_gbps, copy_gbps)
    header = [f"CPU: {cpu}", f"load average at the start: {load}",
              f"memory bandwidth on {os.cpu_count()} threads, best of 5 passes over 256 MB: reading {read_gbps:.1f} "
              f"GB/s, copying {copy_gbps:.1f} GB/s (read + written); the roofline takes {bandwidth:.1f} GB/s"]
    print("\n".join(header), flush=True)

    dtypes_needed = {"bfloat16"}
    if args.pagoda_float32:
        dtypes_needed.add("float32")
    if not args.no_vllm:
        dtypes_needed.update(args.vllm_dtypes)
    if not args.no_hf:
        dtypes_needed.update(args.hf_dtypes)
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    models = {dtype: checkpoint(args.checkpoint_dir, args.layers, dtype) for dtype in sorted(dtypes_needed)}
    config = json.loads((models["bfloat16"] / "config.json").read_text())
    requests, prompt = workloads(models["bfloat16"], args.num_requests, args.max_output, args.batch1_tokens)

    roofline_ms = {}
    for dtype in sorted(dtypes_needed):
        experts, dense = decode_bytes(config, BYTES_PER_WEIGHT[dtype])
        roofline_ms[dtype] = (experts + dense) / (bandwidth * 1e9) * 1e3
        header.append(f"a decode token at batch 1 reads, in {dtype}: {experts / 1e6:.1f} MB of expert weights "
                      f"({args.layers} layers x {config['num_experts_per_tok']} of {num_experts(config)} experts "
                      f"x 3 x {config['hidden_size']} x {config['moe_intermediate_size']}) + {dense / 1e6:.1f} MB "
                      f"of attention, router, norms and LM head = {(experts + dense) / 1e6:.1f} MB: "
                      f"{roofline_ms[dtype]:.1f} ms per token at {bandwidth:.1f} GB/s")
        print(header[-1], flush=True)
    header.append(f"workloads: the first {len(requests)} W1 requests ({sum(len(ids) for ids, _ in requests)} "
                  f"prompt, {sum(n for _, n in requests)} output tokens, ignore_eos), all at once; batch 1: "
                  f"(time of {args.batch1_tokens + 1} tokens - time of 1) / {args.batch1_tokens} on a "
                  f"{PROMPT_LEN}-token prompt, median of {args.repeats}")
    print(header[-1], flush=True)

    job = {"max_model_len": 1024, "requests": requests, "batch1_prompt": prompt,
           "batch1_tokens": args.batch1_tokens, "repeats": args.repeats}
    plan = [("pagoda", "bfloat16", None)] + ([("pagoda", "float32", "float32")] if args.pagoda_float32 else [])
    if not args.no_vllm:
        plan += [("vLLM", dtype, dtype) for dtype in args.vllm_dtypes]
    runs, threads = [], None
    log_dir = Path(tempfile.mkdtemp(prefix="pagoda-moe-compare-"))
    for engine, dtype, dtype_arg in plan:
        if engine == "pagoda":
            python, env = sys.executable, dict(os.environ)
            name = f"pagoda ({'its defaults' if dtype_arg is None else '--dtype float32'})"
        else:
            python, env = str(Path(args.vllm_venv, "bin", "python")), serving_compare.vllm_env()
            name = f"vLLM --dtype {dtype}"
        print(f"== {name}, load average {os.getloadavg()[0]:.2f}", flush=True)
        run = Run(engine, dtype)
        try:
            result = run_engine(python, dict(job, engine=engine.lower(), model=str(models[dtype]), dtype=dtype_arg),
                                env, log_dir, f"{engine}-{dtype}", args.timeout)
        except RuntimeError as exc:
            run.error = str(exc)
            print(f"   failed, left out: {exc}", flush=True)
        else:
            run.output_tok_s = result["output_tokens"] / result["requests_seconds"]
            run.ms_per_token = statistics.median(result["batch1_seconds_per_token"]) * 1e3
            run.load_seconds = result["load_seconds"]
            threads = threads or result["threads"]
            print(f"   start-up {run.load_seconds:.1f} s; {run.output_tok_s:.1f} output tok/s "
                  f"({result['output_tokens']} tokens in {result['requests_seconds']:.2f} s); batch 1 "
                  f"{run.ms_per_token:.1f} ms per token (runs: "
                  + ", ".join(f"{s * 1e3:.1f}" for s in result["batch1_seconds_per_token"]) + ")", flush=True)
        runs.append(run)
    if not args.no_hf:
        for dtype in args.hf_dtypes:
            hf_threads = threads or os.cpu_count() or 1
            print(f"== transformers {dtype} (batch 1, {hf_threads} threads), load average "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
            run = Run("transformers", dtype)
            try:
                run.ms_per_token = run_hf(models[dtype], dtype, hf_threads, prompt, args.batch1_tokens,
                                          args.repeats, args.timeout) * 1e3
                print(f"   batch 1 {run.ms_per_token:.1f} ms per token", flush=True)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                run.error = str(exc)
                print(f"   failed, left out: {exc}", flush=True)
            runs.append(run)
    shutil.rmtree(log_dir, ignore_errors=True)
    header.append(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report = "\n".join(header) + "\n\n" + table(runs, len(requests), args.batch1_tokens, roofline_ms)
    print("\n" + report)
    if args.output:
        args.output.write_text(report + "\n")
    return 0 if any(r.engine == "pagoda" and not r.error for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
