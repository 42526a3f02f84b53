"""Fused CPU kernels for the decoder layer's elementwise work (RMSNorm, SiLU-and-mul, RoPE).

``cpu_ops.cpp`` is compiled on first use (about a minute, then cached by torch's
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

from pagoda import host
from pagoda.cpp_extension import load_cpu_extension

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


def _has_gemv() -> bool:
    return host.current().fused_cpu_ops and _compiled_has_gemv()


@lru_cache(maxsize=1)
def _compiled_has_gemv() -> bool:
    ops = _compiled()
    return ops is not None and bool(ops.has_bf16_gemv())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear``, through the bf16 GEMV kernel for decode-sized batches on a CPU."""
    rows = x.numel() // max(1, x.shape[-1])
    if (rows <= GEMV_MAX_ROWS and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.device.type == "cpu" and weight.is_contiguous() and _has_gemv()):
        x2 = x.reshape(rows, x.shape[-1])
        if x2.stride(-1) == 1:
            return cpu_ops().gemv_bf16(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x, weight, bias)
