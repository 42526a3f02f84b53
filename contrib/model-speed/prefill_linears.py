"""Time the default model's four linear shapes (summed) at prefill-sized row counts through each of pagoda's
AVX2 bf16 GEMMs and through torch's float32 ``linear`` with float32 weights, best of 7 calls after a warm-up,
2 threads, and print each as ms and GFLOP/s:

    python contrib/model-speed/prefill_linears.py 16 128 512 1024 2048

``tiled``: the widened-tile GEMM (``gemm_bf16_fp32``); ``rows-blocked``: the row-blocked one
(``gemm_bf16_fp32_rows``, taken from ``AVX2_ROWS_GEMM_MIN_ROWS`` rows). Needs the compiled CPU kernels.
"""

from __future__ import annotations

import sys
import time

import torch

from pagoda.host.env import resolve_host_config
from pagoda.modeling.layers import fused_ops

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: (out, in)


def best_ms(fn, reps: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    torch.set_num_threads(2)
    ops = fused_ops.CpuKernels(resolve_host_config()).ops
    if ops is None:
        sys.exit("the CPU kernels are off or could not be built")
    weights = [torch.randn(n, k).bfloat16() for n, k in SHAPES]
    weights_f32 = [w.float() for w in weights]
    for rows in [int(r) for r in sys.argv[1:]] or [16, 128, 512, 1024, 2048]:
        xs = [torch.randn(rows, k).bfloat16() for _, k in SHAPES]
        xs_f32 = [x.float() for x in xs]
        flop = sum(2 * rows * n * k for n, k in SHAPES)
        timings = {
            "tiled": best_ms(lambda: [ops.gemm_bf16_fp32(x, w, None) for x, w in zip(xs, weights)]),
            "rows-blocked": best_ms(lambda: [ops.gemm_bf16_fp32_rows(x, w, None, fused_ops.ROWS_GEMM_BLOCK,
                                                                     fused_ops.rows_gemm_chunk(w.shape[1]))
                                             for x, w in zip(xs, weights)]),
            "torch fp32": best_ms(lambda: [torch.nn.functional.linear(x, w) for x, w in zip(xs_f32, weights_f32)]),
        }
        print(f"rows {rows:5d}: " + "  ".join(f"{name} {ms:7.1f} ms ({flop / ms / 1e6:5.1f} GFLOP/s)"
                                             for name, ms in timings.items()), flush=True)


if __name__ == "__main__":
    main()
