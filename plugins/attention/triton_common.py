"""Host-side choices shared by the Triton attention kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda.plugins.attention.triton_backend import interpreting

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# Row reductions built on tl.reduce with our own combine functions. Triton's tl.max / tl.sum are
# themselves @jit functions, fixed as compiled or interpreted when triton is first imported; these
# follow our kernels' mode, so the kernels also run in the interpreter after triton was imported
# without it.
@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def reduce_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _maximum)


@triton.jit
def reduce_sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _add)


def dot_dtype(dtype: torch.dtype):
    """The operand type of ``tl.dot``: the storage type, except bf16 under the interpreter.

    The interpreter multiplies bf16 tiles as raw integers (numpy has no bf16), so there
    the kernels widen bf16 operands to fp32 after rounding them exactly as the GPU does.
    """
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return _TL_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 models get exact fp32 products, not TF32, so they match the fp32 reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and warps of the attention kernels for one (dtype, head size).

    Chosen so that no kernel spills registers on sm_80 / sm_90 (checked with ptxas -v on the
    compiled kernels): fp32 tiles are smaller because fp32 ``tl.dot`` runs without tensor cores
    and keeps more live values.
    """

    decode_tile_n: int  # keys per decode loop iteration
    decode_warps: int
    prefill_rows: int  # (query token, head) rows per prefill program
    prefill_tile_n: int  # keys per prefill loop iteration
    prefill_warps: int


def tiles_for(dtype: torch.dtype, head_dim: int) -> Tiles:
    wide = head_dim > 128
    if dtype == torch.float32:
        return Tiles(16, 8, 16, 16, 4) if wide else Tiles(32, 8, 32, 32, 8)
    return Tiles(32, 8, 32, 32, 8) if wide else Tiles(32, 4, 64, 64, 8)
