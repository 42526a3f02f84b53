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


@triton.jit
def online_softmax_update(s, m, l):
    """One key tile of the online softmax, in base 2 (``exp2``), for each row of scores.

    ``s`` [rows, keys]: the tile's scores, -inf where a key is masked; ``m``, ``l`` [rows]: the running max
    and the running sum of ``exp2(score - m)`` over the keys before this tile (-inf and 0 before the first).
    Returns the tile's probabilities ``p = exp2(s - m_new)``, ``alpha = exp2(m - m_new)`` (what the output
    accumulated so far is rescaled by: ``acc * alpha[:, None] + p @ v``), and the new running max and sum.
    A row whose keys so far are all masked would give NaN: both kernels give every row a key in its first tile.
    """
    m_new = tl.maximum(m, reduce_max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    return p, alpha, m_new, l * alpha + reduce_sum(p, 1)


# fp8 e4m3fn K/V in bit arithmetic over uint8, not Triton's fp8 types: those need sm_89+ on NVIDIA
# GPUs, so this way the same kernels read and write an fp8 cache on A100s and in the interpreter.
@triton.jit
def fp8e4m3_to_float(b):
    """uint8 e4m3fn codes -> float32 (exact; NaN codes are never written, since writes saturate)."""
    # magnitude bits moved into an fp16's exponent/mantissa give value * 2^-8, subnormals included
    half = ((b & 0x7F).to(tl.int16) << 7).to(tl.float16, bitcast=True)
    f = half.to(tl.float32) * 256.0
    return tl.where((b & 0x80) != 0, -f, f)


@triton.jit
def float_to_fp8e4m3(x):
    """float32 -> uint8 e4m3fn codes: saturate to +-448, round to nearest even (as torch's .to())."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    # normal range (a >= 2^-6): keep 3 mantissa bits (nearest even), rebias the exponent 127 -> 7
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal range: multiples of 2^-9; adding 2^23 rounds a * 2^9 to an integer, nearest even
    sub = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    mag = tl.where(a < 0.015625, sub, normal)
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    return (mag | (sign << 7)).to(tl.uint8)


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
