"""Time the default model's four linear shapes (summed) through pagoda's packed bf16 GEMM (the batch-invariant
mode's, and the default mode's with ``cpu_linear_kernel=packed``) and through ``cpu_linear_kernel=onednn`` (oneDNN's
packed bf16 GEMM on AVX-512 CPUs; on AVX2 the GEMV up to 8 rows and the fp32 GEMM of widened tiles beyond), the
two alternated call by call, and print the median and best of each and their ratio. One thread by default, CPU
time of the process; with ``--threads 2`` also wall time (the kernels' thread split):

    python contrib/model-speed/invariant_linears.py 1 8 128 512
    python contrib/model-speed/invariant_linears.py --threads 2 1 8 128 512
    PAGODA_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python contrib/model-speed/invariant_linears.py

Up to 8 rows each call runs every layer's weights of a 30-layer stand-in (distinct weights, streamed from memory as
in a decode step), beyond that one layer's. Needs the compiled CPU kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from pagoda.host.env import resolve_host_config
from pagoda.modeling.layers.fused_ops import CpuKernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: (out, in)
NUM_LAYERS = 30


def products(kernels: CpuKernels, weights: list[list[torch.Tensor]]) -> list[list]:
    """Per layer, per shape, ``x -> x W^T`` the way ``kernels``' linear layers multiply (packed where they pack)."""
    out = []
    for layer in weights:
        row = []
        for w in layer:
            packed = kernels.pack_weight(w)
            row.append((lambda x, p=packed: kernels.packed_linear(x, p)) if packed is not None
                       else (lambda x, w=w: kernels.linear(x, w)))
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", type=int, nargs="*", default=[1, 8, 128, 512])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    host = resolve_host_config()
    onednn = CpuKernels(dataclasses.replace(host, cpu_linear_kernel="onednn"))
    packed = CpuKernels(dataclasses.replace(host, cpu_linear_kernel="packed"))
    if packed.packed_gemm_ops is None:
        sys.exit("the packed GEMM is off or could not be built here")
    weights = [[torch.randn(n, k).bfloat16() for n, k in SHAPES] for _ in range(NUM_LAYERS)]
    kinds = {"onednn": products(onednn, weights), "packed": products(packed, weights)}
    print(f"onednn: {onednn.isa_paths(torch.bfloat16)['dense linear']}; packed: "
          f"{packed.isa_paths(torch.bfloat16)['dense linear']}; {args.threads} thread(s)")
    for rows in args.rows:
        layers = NUM_LAYERS if rows <= 8 else 1
        xs = [torch.randn(rows, k).bfloat16() for _, k in SHAPES]
        cpu: dict[str, list[float]] = {name: [] for name in kinds}
        wall: dict[str, list[float]] = {name: [] for name in kinds}
        reps = 9 if rows <= 128 else 5
        for rep in range(reps + 1):
            for name, layer_products in kinds.items():
                start, start_wall = time.process_time(), time.perf_counter()
                for layer in layer_products[:layers]:
                    for product, x in zip(layer, xs):
                        product(x)
                if rep:  # the first round warms up
                    cpu[name].append((time.process_time() - start) * 1e3 / layers)
                    wall[name].append((time.perf_counter() - start_wall) * 1e3 / layers)
        med = {name: statistics.median(t) for name, t in cpu.items()}
        line = (f"rows {rows:4d}: " + "  ".join(f"{name} {med[name]:7.3f} ms (best {min(cpu[name]):7.3f})"
                                                for name in kinds)
                + f"  packed / onednn {med['packed'] / med['onednn']:.2f}x (CPU, per layer)")
        if args.threads > 1:
            med_wall = {name: statistics.median(t) for name, t in wall.items()}
            line += f"; wall {med_wall['onednn']:.3f} / {med_wall['packed']:.3f} ms, " \
                    f"{med_wall['packed'] / med_wall['onednn']:.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
