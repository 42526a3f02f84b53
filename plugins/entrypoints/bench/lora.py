"""``--lora-adapters N`` of ``pagoda bench throughput`` and ``pagoda bench latency``: the workload again with N
random-weight LoRA adapters, assigned to the requests round-robin, beside the base model in the same engine.

The adapters are written in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``) into a
temporary directory, adapting every projection the engine can adapt, at rank ``--lora-rank``; the engine is
started with ``--enable-lora`` and, unless given, ``--max-loras N``, ``--max-cpu-loras N`` and
``--max-lora-rank`` the rank. Loading them is timed: reading and checking each from disk, and copying each into
its slot of the stacked weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagoda.errors import ConfigError
from pagoda.execution.lora_request import LoRARequest


def add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="also run the workload with N random-weight LoRA adapters (made in a temporary directory, "
                        "assigned to the requests round-robin) and print its ratio to the base model's run")
    p.add_argument("--lora-rank", type=int, default=16, metavar="R", help="the rank of those adapters (1 to 64)")
    p.add_argument("--lora-rounds", type=int, default=1, metavar="K",
                   help="throughput: K runs with the adapters, alternated with K - 1 more base-model runs")


def apply_lora_args(ns: argparse.Namespace) -> None:
    """Turn ``--lora-adapters`` into the engine options it needs (options given on the command line win)."""
    n, rank = ns.lora_adapters, ns.lora_rank
    if ns.lora_rounds < 1:
        raise ConfigError(f"--lora-rounds {ns.lora_rounds}: pass 1 or more")
    if n < 0:
        raise ConfigError(f"--lora-adapters {n}: pass the number of adapters to make (0: none)")
    if n == 0:
        return
    if not 1 <= rank <= 64:
        raise ConfigError(f"--lora-rank {rank}: a LoRA rank is 1 to 64")
    if ns.max_lora_rank is not None and rank > ns.max_lora_rank:
        raise ConfigError(f"--lora-rank {rank} exceeds --max-lora-rank {ns.max_lora_rank}; raise --max-lora-rank "
                          f"to {rank} or lower --lora-rank")
    ns.enable_lora = True
    ns.max_loras = ns.max_loras or n
    ns.max_cpu_loras = ns.max_cpu_loras or n
    ns.max_lora_rank = ns.max_lora_rank or rank


@dataclass
class AdapterLoad:
    """Seconds per adapter: reading and checking it from disk; copying it into a slot."""

    read_seconds: list[float]
    slot_seconds: list[float]

    def describe(self) -> str:
        return (f"adapter load: read + check {statistics.mean(self.read_seconds) * 1e3:.1f} ms each (median "
                f"{statistics.median(self.read_seconds) * 1e3:.1f}, {len(self.read_seconds)} adapters), copy "
                f"into a slot {statistics.mean(self.slot_seconds) * 1e3:.2f} ms each")


def make_adapters(llm, n: int, rank: int, root: Path) -> tuple[list[LoRARequest], AdapterLoad]:
    """``n`` random adapters of every adaptable projection of ``llm``'s model, written under ``root``, served by
    the engine (``lora-0``, ``lora-1``, ...), and the time their loading took."""
    engine = llm.engine
    manager = engine.runner.lora
    requests, reads, slots = [], [], []
    for i in range(n):
        path = write_random_adapter(root / f"lora-{i}", manager.targets, manager.packed, rank, seed=i)
        request = LoRARequest(f"lora-{i}", engine.next_lora_id(), str(path))
        start = time.perf_counter()
        engine.add_lora(request)
        reads.append(time.perf_counter() - start)
        requests.append(request)
    with torch.inference_mode():
        for request in requests[:engine.config.lora.max_loras]:  # each into a free slot of its own
            start = time.perf_counter()
            manager.begin_pass([request], [1], [0])
            slots.append(time.perf_counter() - start)
            manager.end_pass()
    return requests, AdapterLoad(reads, slots)


def write_random_adapter(out: Path, targets: dict, packed: dict[str, list[str]], rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter directory for the layers ``targets`` (prefix -> ``LoRATarget``; fused layers split
    into their checkpoint projections by ``packed``), A and B drawn at random, small enough to leave the model
    coherent."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors, modules = {}, set()
    for prefix, target in sorted(targets.items()):
        parent, _, leaf = prefix.rpartition(".")
        pieces = packed.get(leaf, [leaf])
        for piece, out_features in zip(pieces, target.output_sizes):
            name = f"base_model.model.{parent}.{piece}"
            a = torch.randn(rank, target.in_features, generator=gen) / target.in_features ** 0.5
            b = torch.randn(out_features, rank, generator=gen) * 0.1 / rank ** 0.5
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a, b
            modules.add(piece)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(modules),
              "bias": "none", "task_type": "CAUSAL_LM"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def round_robin(requests: list[LoRARequest], count: int) -> list[LoRARequest]:
    """The adapter of each of ``count`` requests: request ``i`` takes adapter ``i % len(requests)``."""
    return [requests[i % len(requests)] for i in range(count)]


def throughput_with_adapters(llm, ns: argparse.Namespace, requests: list, json_schema, base) -> None:
    """W1 again with ``--lora-adapters`` adapters round-robin, each LoRA run followed by a base-model run
    (``--lora-rounds`` of them) on the same engine; prints each run and the ratio of the medians."""
    from pagoda.plugins.entrypoints.bench.throughput import run_pagoda

    with tempfile.TemporaryDirectory(prefix="pagoda-bench-lora-") as root:
        loras, load = make_adapters(llm, ns.lora_adapters, ns.lora_rank, Path(root))
        print(f"LoRA: {len(loras)} adapters of rank {ns.lora_rank} (backend {llm.engine.config.lora.backend}), "
              f"request i runs adapter i % {len(loras)}; {load.describe()}")
        run_pagoda(llm, requests[:4], json_schema, round_robin(loras, 4))  # warm-up
        base_tps, lora_tps = [base.output_tps], []
        for round_ in range(ns.lora_rounds):
            with_lora, _ = run_pagoda(llm, requests, json_schema, round_robin(loras, len(requests)))
            lora_tps.append(with_lora.output_tps)
            print(f"pagoda with LoRA: {with_lora.seconds:8.2f} s  {with_lora.output_tps:8.1f} output tok/s  "
                  f"{with_lora.total_tps:8.1f} total tok/s")
            if round_ + 1 < ns.lora_rounds:  # the base model again between LoRA runs
                again, _ = run_pagoda(llm, requests, json_schema)
                base_tps.append(again.output_tps)
                print(f"pagoda, base model: {again.seconds:8.2f} s  {again.output_tps:8.1f} output tok/s")
    ratio = statistics.median(lora_tps) / statistics.median(base_tps)
    print(f"ratio (output tok/s): with {len(loras)} LoRA adapters / base model = {ratio:.1%} (medians of "
          f"{len(lora_tps)} and {len(base_tps)} runs: {_figures(lora_tps)} / {_figures(base_tps)})")


def latency_with_adapters(llm, ns: argparse.Namespace, req, json_schema) -> None:
    """W3 with one adapter, alternated with the base model ``--repeats`` times; prints the TTFT and TPOT of each
    and the TPOT's overhead over the base model (medians)."""
    from pagoda.plugins.entrypoints.bench.throughput import _pagoda_latency

    with tempfile.TemporaryDirectory(prefix="pagoda-bench-lora-") as root:
        loras, load = make_adapters(llm, ns.lora_adapters, ns.lora_rank, Path(root))
        print(f"LoRA: {len(loras)} adapter(s) of rank {ns.lora_rank} (backend {llm.engine.config.lora.backend}), "
              f"the request runs {loras[0].lora_name}; {load.describe()}")
        _pagoda_latency(llm, req, json_schema, loras[0])  # warm-up
        base_runs, lora_runs = [], []
        for _ in range(ns.repeats):
            base_runs.append(_pagoda_latency(llm, req, json_schema))
            lora_runs.append(_pagoda_latency(llm, req, json_schema, loras[0]))
    base_tpot = statistics.median(r[1] for r in base_runs)
    lora_tpot = statistics.median(r[1] for r in lora_runs)
    print(f"pagoda with LoRA: TTFT {statistics.median(r[0] for r in lora_runs) * 1e3:8.1f} ms  "
          f"TPOT {lora_tpot * 1e3:8.2f} ms/token (runs: {_figures([r[1] * 1e3 for r in lora_runs])})")
    print(f"pagoda, base model: TTFT {statistics.median(r[0] for r in base_runs) * 1e3:8.1f} ms  "
          f"TPOT {base_tpot * 1e3:8.2f} ms/token (runs: {_figures([r[1] * 1e3 for r in base_runs])}, alternated)")
    print(f"ratio (TPOT): with a LoRA adapter / base model = {lora_tpot / base_tpot:.3f} "
          f"({lora_tpot / base_tpot - 1:+.1%})")


def _figures(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)
