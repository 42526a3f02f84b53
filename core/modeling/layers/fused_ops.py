"""Fused CPU kernels for the decoder layer's elementwise work (RMSNorm, SiLU-and-mul, RoPE), and bf16 linears.

The elementwise kernels run 8 lanes of intrinsics on AVX2 and the compiler's vectorised loops on AVX-512. bf16
linears take a GEMV for decode-sized batches (AVX-512 BF16 dot products, or fp32 math on AVX2) and, on AVX2, an
fp32 GEMM over widened weight tiles for larger ones. ``cpu_ops.cpp`` is compiled on first use (about a minute, then cached by torch's
extension loader). Where it cannot be built, or for tensors it does not cover
(GPU, other dtypes, odd strides), the layers fall back to plain torch ops that
compute the same values. The ``fused_cpu_ops`` host setting off
(``--no-fused-cpu-ops``, ``PAGODA_FUSED_CPU_OPS=0``) turns the kernels off.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import torch

from pagoda.host import settings as host
from pagoda.host.cpp_extension import load_cpu_extension

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cpu_ops() -> Optional[Any]:
    """The compiled kernels, or None when the ``fused_cpu_ops`` host setting is off or they cannot be built."""
    if not host.current().fused_cpu_ops:
        return None
    return _compiled()


@lru_cache(maxsize=1)
def _compiled() -> Optional[Any]:
    try:  # no FMA contraction: products round as torch's do
        return load_cpu_extension("pagoda_cpu_ops", _SOURCE, ["-ffp-contract=off"])
    except Exception as exc:  # a missing compiler or ninja surfaces as many exception types
        logger.warning("fused CPU kernels unavailable, using torch ops (%s: %s)", type(exc).__name__, exc)
        return None


def fused_for(t: torch.Tensor) -> Optional[Any]:
    """The kernels if they cover ``t`` (a CPU tensor of a supported dtype), else None."""
    if t.device.type != "cpu" or t.dtype not in _DTYPES:
        return None
    return cpu_ops()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension."""
    ops = fused_for(gate_up)
    if ops is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# Up to this many rows, the GEMV kernel beats torch's bf16 matmul here (one thread, the model's shapes with
# weights streamed from memory: 20-24 ms against 36-46 ms per decode step at 1 row, 32-42 against 40-52 at 4,
# 44-61 against 35-43 at 8).
GEMV_MAX_ROWS = 4

# Without bf16 math (the AVX2 build), torch's bf16 matmul widens on the fly and falls far behind fp32 beyond a
# few rows. There the GEMV (fp32 math in registers) takes up to AVX2_GEMV_MAX_ROWS rows and the widened-tile
# fp32 GEMM the rest. The default model's 30 layers and LM head, 2 threads, capped to AVX2, per step:
# 1 row 3.6 ms (fp32 weights: 10.9), 8 rows 16.7 (18.9), 16 rows: GEMV 32, tiled GEMM 25 (fp32: 22),
# 64 rows: tiled GEMM 50-56 (fp32: 44; torch's bf16 matmul: 141).
AVX2_GEMV_MAX_ROWS = 8


def _gemv_path() -> str:
    """The ISA path of the compiled bf16 GEMV: ``avx512_bf16``, ``avx2``, or ``""`` (none, or turned off)."""
    return _compiled_gemv_path() if host.current().fused_cpu_ops else ""


def _has_gemv() -> bool:
    return bool(_gemv_path())


@lru_cache(maxsize=1)
def _compiled_gemv_path() -> str:
    ops = _compiled()
    return str(ops.gemv_path()) if ops is not None else ""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear``; for bf16 on a CPU, through the GEMV kernel for decode-sized batches, and without bf16 math
    (AVX2) through the widened-tile GEMM for larger ones."""
    if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and weight.is_contiguous()):
        path = _gemv_path()
        rows = x.numel() // max(1, x.shape[-1])
        if path == "avx512_bf16" and rows <= GEMV_MAX_ROWS or path == "avx2":
            x2 = x.reshape(rows, x.shape[-1])
            if x2.stride(-1) == 1:
                if path == "avx2" and rows > AVX2_GEMV_MAX_ROWS:
                    y = cpu_ops().gemm_bf16_fp32(x2, weight, bias)
                else:
                    y = cpu_ops().gemv_bf16(x2, weight, bias)
                return y.view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x, weight, bias)


def isa_paths(dtype: torch.dtype) -> dict[str, str]:
    """The ISA path the decoder layer's elementwise kernels and dense linear layers take for a CPU model of
    ``dtype`` (for benchmarks and logs)."""
    from pagoda.modeling.layers import onednn

    ops = cpu_ops()
    elementwise = str(ops.elementwise_path()) if ops is not None and dtype in _DTYPES else "torch"
    if dtype != torch.bfloat16:
        dense = "torch"
    elif onednn.packing_available():
        dense = "onednn packed bf16" + (f", gemv {_gemv_path()} up to {GEMV_MAX_ROWS} rows (LM head)"
                                        if _gemv_path() == "avx512_bf16" else "")
    elif _gemv_path() == "avx2":
        dense = f"avx2 (gemv up to {AVX2_GEMV_MAX_ROWS} rows, fp32 GEMM of widened tiles beyond)"
    elif _gemv_path():
        dense = f"gemv {_gemv_path()} up to {GEMV_MAX_ROWS} rows, torch beyond"
    else:
        dense = "torch"
    return {"rmsnorm/silu/rope": elementwise, "dense linear": dense}
