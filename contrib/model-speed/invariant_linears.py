"""Time the default model's four linear shapes (summed) through the batch-invariant mode's packed bf16 GEMM and
through what the same engine runs with the mode off (oneDNN's packed bf16 GEMM on AVX-512 CPUs; on AVX2 the GEMV
up to 8 rows and the fp32 GEMM of widened tiles beyond), one thread, CPU time of the calling thread, the two
alternated call by call, and print the median and best of each and their ratio:

    python contrib/model-speed/invariant_linears.py 1 8 128 512
    PAGODA_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python contrib/model-speed/invariant_linears.py

Up to 8 rows each call runs every layer's weights of a 30-layer stand-in (distinct weights, streamed from memory as
in a decode step), beyond that one layer's. Needs the compiled CPU kernels.
"""

from __future__ import annotations

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
    torch.set_num_threads(1)
    host = resolve_host_config()
    off, on = CpuKernels(host), CpuKernels(host, batch_invariant=True)
    if on.invariant_ops is None:
        sys.exit("the batch-invariant GEMM is off or could not be built here")
    weights = [[torch.randn(n, k).bfloat16() for n, k in SHAPES] for _ in range(NUM_LAYERS)]
    kinds = {"mode off": products(off, weights), "invariant": products(on, weights)}
    print(f"mode off: {off.isa_paths(torch.bfloat16)['dense linear']}; invariant: "
          f"{on.isa_paths(torch.bfloat16)['dense linear']}")
    for rows in [int(r) for r in sys.argv[1:]] or [1, 8, 128, 512]:
        layers = NUM_LAYERS if rows <= 8 else 1
        xs = [torch.randn(rows, k).bfloat16() for _, k in SHAPES]
        times: dict[str, list[float]] = {name: [] for name in kinds}
        reps = 9 if rows <= 128 else 5
        for rep in range(reps + 1):
            for name, layer_products in kinds.items():
                start = time.thread_time()
                for layer in layer_products[:layers]:
                    for product, x in zip(layer, xs):
                        product(x)
                if rep:  # the first round warms up
                    times[name].append((time.thread_time() - start) * 1e3 / layers)
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"rows {rows:4d}: " + "  ".join(f"{name} {med[name]:7.3f} ms (best {min(times[name]):7.3f})"
                                             for name in kinds)
              + f"  invariant / off {med['invariant'] / med['mode off']:.2f}x (per layer)", flush=True)


if __name__ == "__main__":
    main()
