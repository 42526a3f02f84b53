"""``pagoda bench throughput`` (W1) and ``pagoda bench latency`` (W3), each against HF transformers in the same run."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from pagoda.cli import add_engine_args, engine_args_from
from pagoda.errors import ConfigError
from pagoda.plugins.entrypoints.bench.lora import add_lora_args, apply_lora_args
from pagoda.plugins.entrypoints.bench.workloads import BenchRequest, latency_1, random_64


def add_parser(sub, name: str) -> None:
    if name == "throughput":
        p = sub.add_parser("throughput", help="W1: 64 random requests at once; pagoda vs HF static batches of 16")
        p.add_argument("--num-requests", type=int, default=64)
        p.add_argument("--hf-batch-size", type=int, default=16)
        p.add_argument("--hf-batches", type=int, default=None,
                       help="run only the first N HF batches (the ratio uses tokens/s, so a subset still compares)")
        p.add_argument("--roofline", action="store_true",
                       help="after the run, time this machine's GEMMs at the model's shapes and print how close the "
                            "run's matmuls came to them (adds about a minute on a small CPU)")
        p.set_defaults(func=run_throughput)
    else:
        p = sub.add_parser("latency", help="W3: one request, 128 prompt + 128 output tokens; pagoda vs HF batch 1")
        p.add_argument("--prompt-len", type=int, default=128)
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--repeats", type=int, default=3)
        p.set_defaults(func=run_latency)
    p.add_argument("--hf-dtype", default="float32", help="dtype of the HF baseline (float32 or bfloat16)")
    p.add_argument("--no-baseline", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--hf-same-process", action="store_true",
                   help="run the HF baseline inside the benchmark process, with pagoda's malloc and OpenMP "
                        "settings (default: a fresh process, as HF users run it)")
    p.add_argument("--profile", action="store_true", help="print where a decode step's time goes")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain every request's output to this JSON schema (structured outputs; each request "
                        "then ends where its JSON does, or at its output length); --profile then shows the "
                        "grammar mask's share of a decode step")
    add_lora_args(p)
    add_engine_args(p)


@dataclass
class Result:
    seconds: float
    prompt_tokens: int
    output_tokens: int

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def _make_llm(ns: argparse.Namespace):
    from pagoda.engine.llm import LLM

    apply_lora_args(ns)
    args = engine_args_from(ns)
    llm = LLM(**args.model_dump(exclude_defaults=True), plugin_manager=ns.plugin_manager)
    # one configuration for the whole run: pagoda, the roofline, the profile and the baseline all get the
    # thread count measured at start-up
    llm.engine.host.hold_threads()
    return llm


def _params(n_out: int, json_schema: Optional[dict] = None):
    from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

    if json_schema is not None:  # the JSON ends the output (with EOS) where the schema lets it
        return SamplingParams(temperature=0.0, max_tokens=n_out,
                              structured_outputs=StructuredOutputsParams(json=json_schema))
    return SamplingParams(temperature=0.0, max_tokens=n_out, min_tokens=n_out, ignore_eos=True)


def _load_schema(path: Optional[str]) -> Optional[dict]:
    if path is None:
        return None
    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--json-schema {path}: cannot read a JSON schema from it ({exc}); pass a file holding "
                          "one JSON schema object") from None
    if not isinstance(schema, dict):
        raise ConfigError(f"--json-schema {path} holds a {type(schema).__name__}, not a JSON schema object")
    return schema


def _print_compile_times(llm, json_schema: dict) -> None:
    """The schema's compile time, cold and cached (after the backend's one-off set-up on another schema)."""
    from pagoda.sampling_params import StructuredOutputsParams

    so = llm.engine.structured_outputs
    t0 = time.perf_counter()
    setup = so.compiled(StructuredOutputsParams(json_object=True))  # builds the backend's tokenizer tables
    t1 = time.perf_counter()
    so.compiled(StructuredOutputsParams(json=json_schema))
    t2 = time.perf_counter()
    so.compiled(StructuredOutputsParams(json=json_schema))
    t3 = time.perf_counter()
    print(f"JSON schema on every request ({setup.backend_name}): backend set-up {(t1 - t0) * 1e3:.0f} ms, "
          f"compile cold {(t2 - t1) * 1e3:.1f} ms, cached {(t3 - t2) * 1e3:.3f} ms")


def run_pagoda(llm, requests: list[BenchRequest], json_schema: Optional[dict] = None,
               lora_requests: Optional[list] = None) -> tuple[Result, dict]:
    """Submit every request at once and step to completion; tracks KV use at its peak (and, under a JSON
    schema, the seconds each step spent filling and applying the token mask). ``lora_requests``: each request's
    LoRA adapter (None: the base model for all)."""
    engine = llm.engine
    for i, r in enumerate(requests):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": r.prompt_token_ids}, _params(r.output_len, json_schema),
                           lora_request=None if lora_requests is None else lora_requests[i])
    kv, sched = engine.kv_manager, engine.scheduler
    peak = {"blocks": 0, "tokens": 0, "steps": [], "mask": []}

    class StepRecorder:
        """Per step: linear-layer tokens and LM-head rows (for the roofline), and KV use at its peak."""

        def __init__(self) -> None:
            # id of a step scheduled -> its sequences' output tokens then (with pipeline steps in flight, the next
            # steps are scheduled before one is committed)
            self.outputs_before: dict[int, int] = {}

        def before_step(self, engine, sched) -> None:
            self.outputs_before[id(sched)] = sum(r.num_output_tokens for r in sched.requests)

        def after_step(self, engine, sched_out, result, seconds) -> None:
            before = self.outputs_before.pop(id(sched_out))
            peak["steps"].append((sched_out.num_batched_tokens,
                                  sum(r.num_output_tokens for r in sched_out.requests) - before))
            if sched_out.grammar_rows:
                peak["mask"].append((len(sched_out.grammar_rows), engine.structured_outputs.last_fill_seconds,
                                     engine.runner.timings.get("grammar", 0.0)))
            held_blocks = sum(kv.num_blocks_held(r.request_id) for r in sched.running)
            if held_blocks > peak["blocks"]:
                peak.update(blocks=held_blocks, tokens=sum(r.num_computed_tokens for r in sched.running))

    recorder = StepRecorder()
    engine.observers.append(recorder)
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.observers.remove(recorder)
    seconds = time.perf_counter() - start
    # the tokens the sequences produced (all of output_len each, unless a JSON schema ended them sooner)
    num_output = sum(new for _, new in peak["steps"])
    return Result(seconds, sum(len(r.prompt_token_ids) for r in requests), num_output), peak


def run_hf(llm, ns: argparse.Namespace, kind: str, requests: list[BenchRequest], **extra) -> dict:
    """The HF transformers baseline on the same requests, in a fresh process unless ``--hf-same-process``."""
    job = {"kind": kind, "model": llm.engine.config.model.model, "dtype": str(_dtype(ns.hf_dtype)).removeprefix("torch."),
           "threads": llm.engine.num_threads, "requests": [[r.prompt_token_ids, r.output_len] for r in requests],
           **extra}
    if ns.hf_same_process:
        from pagoda.plugins.entrypoints.bench import hf_baseline

        return hf_baseline.run(job)
    from pagoda.host import openmp
    from pagoda.plugins.entrypoints.bench import hf_baseline

    # the child gets the user's environment, not the OpenMP settings pagoda chose for itself
    env = {k: v for k, v in os.environ.items() if k not in openmp.set_here}
    proc = subprocess.run([sys.executable, hf_baseline.__file__], input=json.dumps(job), capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the HF transformers baseline failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout)
    if result.get("pagoda_imported", True):
        # its timings would be taken under the malloc and OpenMP settings pagoda gives its own process
        raise RuntimeError(f"the HF transformers baseline's process imported pagoda ({hf_baseline.__file__} must "
                           "stay free of pagoda imports to be a baseline of its own); report this as a bug")
    return result


def _special_ids(tokenizer) -> set[int]:
    return set(tokenizer.all_special_ids)


def _print_speculation(llm) -> None:
    stats = llm.engine.spec_stats
    if stats is not None:
        print(f"speculation: {stats.num_drafts} verify runs, {stats.num_draft_tokens} draft tokens, acceptance "
              f"{stats.acceptance_rate:.1%}, {stats.mean_acceptance_length:.2f} tokens per verify run")


def _print_header(llm) -> None:
    from pagoda.host.dtypes import stored_kv_dtype

    cfg = llm.engine.config
    print(f"model: {cfg.model.model}  dtype: {str(cfg.model.dtype).replace('torch.', '')}  "
          f"threads: {llm.engine.num_threads}  attention: {llm.engine.backend.name}  "
          f"KV blocks: {llm.engine.num_blocks} x {cfg.cache.block_size} "
          f"({str(stored_kv_dtype(llm.engine.backend, cfg.model.dtype)).replace('torch.', '')})")
    if llm.engine.window_pool is not None:
        print(f"KV window pool: {llm.engine.window_pool.summary()}")
    from pagoda.plugins.quant.memory import weight_memory

    print(f"weights ({cfg.model.quantization or 'unquantized'}): {weight_memory(llm.engine.model).describe()}")
    from pagoda.host import cpu_isa, openmp

    print(f"OpenMP waiting: {openmp.wait_policy}  CPU kernels built for: {cpu_isa.describe(cfg.host.cpu_isa)}")
    paths = kernel_isa_paths(llm)
    if paths:
        print("kernel ISA paths: " + "; ".join(f"{kernel} {path}" for kernel, path in paths.items()))


def kernel_isa_paths(llm) -> dict[str, str]:
    """Which ISA path each CPU kernel of this engine takes (empty off a CPU)."""
    cfg = llm.engine.config
    if cfg.device != "cpu":
        return {}
    from pagoda.modeling.layers.fused_ops import CpuKernels

    paths = dict(llm.engine.backend.isa_paths())
    if cfg.lora is not None:
        from pagoda.execution.lora_backends import lora_isa_path

        paths["LoRA"] = lora_isa_path(cfg.lora.backend, cfg.host)
    # the CPU kernels pagoda's own architectures choose from these host settings (the same choice as the model's)
    paths.update(CpuKernels(cfg.host, cfg.model.batch_invariant).isa_paths(cfg.model.dtype))
    if cfg.model.quantization in ("awq", "gptq", "compressed-tensors"):
        from pagoda.plugins.quant.base import kernel_for_device
        from pagoda.plugins.quant.cpu_int_kernel import isa_path

        kernel = kernel_for_device(cfg.host.quant_kernel)
        paths["int linear"] = isa_path(cfg.host) if kernel == "cpu" else kernel
    from pagoda.plugins.quant.int8 import uses_int8_kernel

    if uses_int8_kernel(llm.engine.model):
        from pagoda.plugins.quant.base import kernel_for_device
        from pagoda.plugins.quant.cpu_int8_kernel import isa_path as int8_isa_path

        kernel = kernel_for_device(cfg.host.quant_kernel)
        paths["int8 linear"] = int8_isa_path(cfg.host) if kernel == "cpu" else "torch"
    return paths


def run_throughput(ns: argparse.Namespace) -> int:
    llm = _make_llm(ns)
    tok = llm.get_tokenizer()
    requests = random_64(llm.engine.config.model.vocab_size, _special_ids(tok), ns.num_requests)
    _print_header(llm)
    print(f"W1: {len(requests)} requests, {sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
          f"{sum(r.output_len for r in requests)} output tokens")
    json_schema = _load_schema(ns.json_schema)
    if json_schema is not None:
        _print_compile_times(llm, json_schema)
    run_pagoda(llm, requests[:4], json_schema)  # warm-up
    mine, peak = run_pagoda(llm, requests, json_schema)
    waste = 1 - peak["tokens"] / max(1, peak["blocks"] * llm.engine.config.cache.block_size)
    print(f"pagoda: {mine.seconds:8.2f} s  {mine.output_tps:8.1f} output tok/s  {mine.total_tps:8.1f} total tok/s")
    print(f"KV cache at peak: {peak['blocks']} blocks hold {peak['tokens']} tokens -> waste {waste:.1%}")
    if peak["mask"]:
        rows, fill, apply = (sum(x) / len(peak["mask"]) for x in zip(*peak["mask"]))
        print(f"JSON schema mask: {len(peak['mask'])} steps, mean {rows:.1f} rows: fill {fill * 1e3:.2f} ms + apply "
              f"{apply * 1e3:.2f} ms per step (apply: with the rows after speculative drafts) "
              f"({(fill + apply) * len(peak['mask']) / mine.seconds:.1%} of the run)")
    _print_speculation(llm)
    if ns.lora_adapters:
        from pagoda.plugins.entrypoints.bench.lora import throughput_with_adapters

        throughput_with_adapters(llm, ns, requests, json_schema, mine)
    if ns.roofline:
        from pagoda.plugins.entrypoints.bench.roofline import measure_roofline, report

        roofline = measure_roofline(llm.engine.model, llm.engine.config.model.num_layers)
        print(report(roofline, peak["steps"], mine.seconds))
    if ns.profile:
        from pagoda.plugins.entrypoints.bench.profile import profile_decode

        profile_decode(llm, requests, json_schema=json_schema)
    if not ns.no_baseline:
        subset = requests if ns.hf_batches is None else requests[:ns.hf_batches * ns.hf_batch_size]
        seconds = run_hf(llm, ns, "static", subset, batch_size=ns.hf_batch_size)["seconds"]
        hf = Result(seconds, sum(len(r.prompt_token_ids) for r in subset), sum(r.output_len for r in subset))
        print(f"HF transformers ({ns.hf_dtype}, static batches of {ns.hf_batch_size}, {len(subset)} requests, "
              f"{_where(ns)}): "
              f"{hf.seconds:8.2f} s  {hf.output_tps:8.1f} output tok/s  {hf.total_tps:8.1f} total tok/s")
        print(f"ratio (output tok/s): pagoda / HF = {mine.output_tps / hf.output_tps:.1f}x")
    return 0


def run_latency(ns: argparse.Namespace) -> int:
    llm = _make_llm(ns)
    tok = llm.get_tokenizer()
    req = latency_1(llm.engine.config.model.vocab_size, _special_ids(tok), ns.prompt_len, ns.output_len)
    _print_header(llm)
    print(f"W3: 1 request, {ns.prompt_len} prompt tokens, {ns.output_len} output tokens, median of {ns.repeats}")
    json_schema = _load_schema(ns.json_schema)
    if json_schema is not None:
        _print_compile_times(llm, json_schema)
    _pagoda_latency(llm, req, json_schema)  # warm-up
    runs = [_pagoda_latency(llm, req, json_schema) for _ in range(ns.repeats)]
    ttft = statistics.median(r[0] for r in runs)
    tpot = statistics.median(r[1] for r in runs)
    print(f"pagoda: TTFT {ttft * 1e3:8.1f} ms  TPOT {tpot * 1e3:8.2f} ms/token")
    _print_speculation(llm)
    if ns.lora_adapters:
        from pagoda.plugins.entrypoints.bench.lora import latency_with_adapters

        latency_with_adapters(llm, ns, req, json_schema)
    if ns.profile:
        from pagoda.plugins.entrypoints.bench.profile import profile_decode

        profile_decode(llm, [req], json_schema=json_schema)
    if not ns.no_baseline:
        hf = run_hf(llm, ns, "latency", [req], repeats=ns.repeats)
        hf_ttft, hf_tpot = hf["ttft"], hf["tpot"]
        print(f"HF transformers ({ns.hf_dtype}, batch 1, {_where(ns)}): TTFT {hf_ttft * 1e3:8.1f} ms  TPOT {hf_tpot * 1e3:8.2f} ms/token")
        print(f"ratio (TPOT): HF / pagoda = {hf_tpot / tpot:.1f}x")
    return 0


def _pagoda_latency(llm, req: BenchRequest, json_schema: Optional[dict] = None,
                    lora_request=None) -> tuple[float, float]:
    """TTFT and TPOT of one request (TPOT over the tokens it produced: a JSON schema may end it sooner). The
    prompt is computed cold: the blocks an earlier run of the same prompt left in the prefix cache are dropped
    first (with them a repeat's TTFT was a cache hit's, about a third of a 128-token prefill here)."""
    engine = llm.engine
    engine.kv_manager.reset_prefix_cache()
    start = time.perf_counter()
    engine.add_request(f"lat-{time.monotonic_ns()}", {"prompt_token_ids": req.prompt_token_ids},
                       _params(req.output_len, json_schema), lora_request=lora_request)
    first, num_tokens = None, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        for o in outs:  # cumulative outputs: the tokens so far
            num_tokens = max(num_tokens, sum(len(c.token_ids) for c in o.outputs))
        if first is None and outs:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - start, (end - first) / max(1, num_tokens - 1)


def _where(ns: argparse.Namespace) -> str:
    return "in this process" if ns.hf_same_process else "in a fresh process"


def _dtype(name: str) -> torch.dtype:
    from pagoda.host.dtypes import resolve_dtype

    return resolve_dtype(name)
