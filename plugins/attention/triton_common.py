"""Host-side choices shared by the Triton attention kernels."""

from __future__ import annotations

import torch
import triton.language as tl

from pagoda.plugins.attention.triton_backend import interpreting

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


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
