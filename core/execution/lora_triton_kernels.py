"""The Triton kernels of the ``triton`` LoRA backend (see ``triton_backend.py``)."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import triton
import triton.language as tl


@triton.jit
def shrink_kernel(x_ptr, a_ptr, t_ptr, rows_ptr, slots_ptr, in_features, rank, stride_x,
                  BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """t[i, r] = sum_k lora_a[slot_i, r, k] * x[rows_i, k] for a block of BLOCK_R rank rows r (fp32)."""
    i = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row = tl.load(rows_ptr + i)
    slot = tl.load(slots_ptr + i)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + k, mask=k < in_features, other=0.0).to(tl.float32)  # [BLOCK_K]
        a = tl.load(a_ptr + slot * rank * in_features + r[:, None] * in_features + k[None, :],
                    mask=(r[:, None] < rank) & (k[None, :] < in_features), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(t_ptr + i * rank + r, acc, mask=r < rank)


@triton.jit
def expand_kernel(t_ptr, b_ptr, y_ptr, rows_ptr, slots_ptr, rank, out_features, stride_y,
                  BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[rows_i, o] += sum_r lora_b[slot_i, o, r] * t[i, r] for a block of BLOCK_N output rows o."""
    i = tl.program_id(0)
    o = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    row = tl.load(rows_ptr + i)
    slot = tl.load(slots_ptr + i)
    t = tl.load(t_ptr + i * rank + r, mask=r < rank, other=0.0)  # [BLOCK_R] fp32
    b = tl.load(b_ptr + slot * out_features * rank + o[:, None] * rank + r[None, :],
                mask=(o[:, None] < out_features) & (r[None, :] < rank), other=0.0).to(tl.float32)
    y_at = y_ptr + row * stride_y + o
    y = tl.load(y_at, mask=o < out_features, other=0.0)
    tl.store(y_at, (y.to(tl.float32) + tl.sum(b * t[None, :], axis=1)).to(y.dtype), mask=o < out_features)


def defined_in_this_mode() -> ModuleType:
    """This module, its kernels defined compiled or interpreted as TRITON_INTERPRET says now (Triton decides when
    a kernel is defined; a module first imported in the other mode is executed again)."""
    from triton.runtime.interpreter import InterpretedFunction

    from pagoda.execution.lora_triton import interpreting

    module = sys.modules[__name__]
    if isinstance(shrink_kernel, InterpretedFunction) != interpreting():
        module = importlib.reload(module)
    return module
