"""``pagoda bench kernels``: time each attention backend's forward on given shapes.

One forward = the KV write of the step's new tokens plus attention over the
paged K/V, as one layer runs it (metadata is built once, outside the timing,
as the engine builds it once per step); successive forwards rotate over
several KV caches, as layers do, so K/V are not served from the cache. On a GPU the time comes from CUDA
events and the achieved memory bandwidth is set against the device's peak; on
a CPU wall-clock time is used and the reference is a measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagoda.config import CacheConfig, ModelConfig
from pagoda.errors import BackendUnavailable
from pagoda.host.dtypes import resolve_dtype
from pagoda.plugins.attention.triton_backend import TritonAttentionBackend
from pagoda.registry.adapt import adapt_component
from pagoda.step import AttentionBatch

# GB/s of devices whose properties do not report their memory clock; matched by name substring
KNOWN_PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
                   "A100-PCIE-80GB": 1935, "A100": 1555, "L40S": 864, "L4": 300, "A10G": 600, "A10": 600,
                   "RTX 4090": 1008, "RTX 3090": 936}


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="time each attention backend (KV write + paged attention) on given shapes")
    p.add_argument("--backends", default=None,
                   help="comma-separated backend names (default: every installed backend that can run here)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="requests per step")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048], help="KV length of every request")
    p.add_argument("--query-len", type=int, default=1, help="new tokens per request: 1 = decode, more = prefill chunk")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", help="float32, float16 or bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads on a CPU (default: $PAGODA_CPU_THREADS, else measured)")
    p.set_defaults(func=run)


@dataclass
class Workload:
    batch_size: int
    seq_len: int
    query_len: int

    def bytes_moved(self, num_heads: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
        """Compulsory traffic: read all K/V once, read q and the new k/v, write the new k/v and the output."""
        tokens = self.batch_size * self.query_len
        kv_read = self.batch_size * self.seq_len * num_kv_heads * head_dim * 2
        per_token = num_heads * head_dim * 2 + num_kv_heads * head_dim * 4
        return (kv_read + tokens * per_token) * element_size

    def flops(self, num_heads: int, head_dim: int) -> int:
        # QK^T and PV, 2 flops per multiply-add each; query i of a chunk sees context + i + 1 keys
        ctx = self.seq_len - self.query_len
        keys = self.query_len * ctx + self.query_len * (self.query_len + 1) // 2
        return 4 * num_heads * head_dim * keys * self.batch_size


def make_batch(w: Workload, block_size: int, gen: torch.Generator) -> tuple[AttentionBatch, int]:
    """Shuffled block tables over a pool that holds exactly the batch; returns the batch and the pool size."""
    blocks_per_req = math.ceil(w.seq_len / block_size)
    num_blocks = w.batch_size * blocks_per_req
    block_tables = torch.randperm(num_blocks, generator=gen).view(w.batch_size, blocks_per_req).to(torch.int32)
    positions = torch.arange(w.seq_len - w.query_len, w.seq_len)
    slots = block_tables[:, positions // block_size].to(torch.int64) * block_size + positions % block_size
    qsl = [i * w.query_len for i in range(w.batch_size + 1)]
    seq_lens = [w.seq_len] * w.batch_size
    batch = AttentionBatch(
        num_reqs=w.batch_size, num_decodes=w.batch_size if w.query_len == 1 else 0,
        num_tokens=w.batch_size * w.query_len, query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        slot_mapping=slots.reshape(-1), query_start_loc_list=qsl, seq_lens_list=seq_lens,
        max_query_len=w.query_len, max_seq_len=w.seq_len, block_size=block_size,
    )
    return batch, num_blocks


def model_config(ns: argparse.Namespace, dtype: torch.dtype) -> ModelConfig:
    return ModelConfig(
        model="", tokenizer="", served_model_name="bench", hf_config={}, architecture="LlamaForCausalLM", dtype=dtype,
        max_model_len=max(ns.seq_lens), seed=0, load_format="dummy", quantization=None, quant_config=None,
        chat_template=None, vocab_size=1, hidden_size=ns.num_heads * ns.head_dim, num_layers=1,
        num_heads=ns.num_heads, num_kv_heads=ns.num_kv_heads, head_dim=ns.head_dim,
    )


def cache_config(ns: argparse.Namespace) -> CacheConfig:
    return CacheConfig(block_size=ns.block_size, kv_cache_memory_bytes=1 << 30, kv_cache_dtype="auto",
                       enable_prefix_caching=False, num_gpu_blocks_override=None, swap_space_bytes=0,
                       preemption_mode="recompute", kv_allocator="paged")


class Layer:
    def __init__(self, head_dim: int) -> None:
        self.scale = head_dim ** -0.5


def last_level_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 50 << 20)
    return 64 << 20  # a generous CPU last-level cache


def time_forward(backend: Any, w: Workload, ns: argparse.Namespace, dtype: torch.dtype,
                 device: torch.device) -> float:
    """Seconds per forward.

    Successive forwards use different KV caches, like a model's layers, so that together they
    exceed the last-level cache several times and K/V really come from memory."""
    gen = torch.Generator().manual_seed(0)
    batch, num_blocks = make_batch(w, ns.block_size, gen)
    shape = backend.kv_cache_shape(num_blocks)
    cache_bytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    num_layers = max(1, min(32, math.ceil(4 * last_level_cache_bytes(device) / cache_bytes)))
    caches = [torch.randn(shape, generator=gen).to(device, dtype) for _ in range(num_layers)]
    tokens = batch.num_tokens
    q = torch.randn(tokens, ns.num_heads, ns.head_dim, generator=gen).to(device, dtype)
    k = torch.randn(tokens, ns.num_kv_heads, ns.head_dim, generator=gen).to(device, dtype)
    v = torch.randn(tokens, ns.num_kv_heads, ns.head_dim, generator=gen).to(device, dtype)
    md = backend.build_metadata(batch)
    layer = Layer(ns.head_dim)
    with torch.inference_mode():
        for i in range(ns.warmup):
            backend.forward(layer, q, k, v, caches[i % num_layers], md)
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(ns.iters):
                backend.forward(layer, q, k, v, caches[i % num_layers], md)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / ns.iters
        t0 = time.perf_counter()
        for i in range(ns.iters):
            backend.forward(layer, q, k, v, caches[i % num_layers], md)
        return (time.perf_counter() - t0) / ns.iters


def gpu_peak_gbps() -> tuple[Optional[float], str]:
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, f"{props.name} (memory clock x bus width, DDR)"
    for key, gbps in KNOWN_PEAK_GBPS.items():
        if key in props.name:
            return float(gbps), f"{props.name} (datasheet)"
    return None, f"{props.name} (peak unknown)"


def cpu_copy_gbps(num_bytes: int = 1 << 28) -> float:
    """Best of five copies of a large buffer: bytes read + written per second."""
    src = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best / 1e9


def run(ns: argparse.Namespace) -> int:
    dtype = resolve_dtype(ns.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        peak, peak_source = gpu_peak_gbps()
    else:
        from pagoda.host.env import resolve_cpu_threads
        from pagoda.host.threads import configure_threads

        print(f"cpu threads: {configure_threads(resolve_cpu_threads(ns.cpu_threads))}")
        peak, peak_source = cpu_copy_gbps(), "measured CPU copy bandwidth"
    print(f"device: {device.type}; reference bandwidth: "
          f"{'unknown' if peak is None else f'{peak:.0f} GB/s'} ({peak_source})")
    print(f"shape: heads {ns.num_heads}/{ns.num_kv_heads} kv, head_dim {ns.head_dim}, block_size {ns.block_size}, "
          f"{dtype}, query_len {ns.query_len}")
    available = ns.plugin_manager.components.get("pagoda_attention_backends", {})
    names = ns.backends.split(",") if ns.backends else sorted(available)
    mc, cc = model_config(ns, dtype), cache_config(ns)
    element_size = torch.empty(0, dtype=dtype).element_size()
    print(f"{'backend':<10}{'batch':>6}{'seq_len':>9}{'ms':>10}{'GB/s':>9}{'% ref':>7}{'TFLOP/s':>9}")
    for name in names:
        if name not in available:
            print(f"{name:<10} not installed (installed: {', '.join(sorted(available))})")
            continue
        try:
            backend = adapt_component(available[name].factory(mc, cc), "pagoda_attention_backends", name)
        except BackendUnavailable as exc:
            print(f"{name:<10} skipped: {exc}")
            continue
        if device.type == "cpu" and isinstance(backend, TritonAttentionBackend):
            print(f"{name:<10} skipped: runs in the Triton interpreter here, which says nothing about speed")
            continue
        paths = backend.isa_paths()
        if paths:
            print(f"{name:<10} ISA paths: " + "; ".join(f"{k} {v}" for k, v in paths.items()))
        for batch_size in ns.batch_sizes:
            for seq_len in ns.seq_lens:
                w = Workload(batch_size, seq_len, min(ns.query_len, seq_len))
                seconds = time_forward(backend, w, ns, dtype, device)
                gbps = w.bytes_moved(ns.num_heads, ns.num_kv_heads, ns.head_dim, element_size) / seconds / 1e9
                share = f"{100 * gbps / peak:.0f}%" if peak else "-"
                tflops = w.flops(ns.num_heads, ns.head_dim) / seconds / 1e12
                print(f"{name:<10}{batch_size:>6}{seq_len:>9}{seconds * 1e3:>10.3f}{gbps:>9.{3 if gbps < 1 else 1}f}{share:>7}"
                      f"{tflops:>9.2f}")
    return 0
