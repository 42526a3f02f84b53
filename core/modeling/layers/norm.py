"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.modeling.layers.fused_ops import CpuKernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, kernels: Optional[CpuKernels] = None) -> None:
        """``kernels``: the model's CPU kernels (None: torch ops)."""
        super().__init__()
        self.kernels = kernels or CpuKernels()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.hidden_size = hidden_size

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Normalise ``x`` (after adding ``residual``). Returns ``y`` or ``(y, new_residual)``.

        On a CPU the fused kernel adds into ``residual`` in place and writes ``y`` over ``x``
        (both are the step's own activations); without a residual ``x`` is left untouched.
        """
        ops = self.kernels.for_tensor(x)
        if ops is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            if residual is None:
                y = torch.empty_like(x)
                ops.add_rms_norm(x, None, self.weight, self.eps, y)
                return y
            ops.add_rms_norm(x, residual, self.weight, self.eps, x)
            return x, residual
        if residual is not None:
            x = x + residual
            residual = x
        # one fused kernel; it accumulates in float32 for bf16/fp16 inputs
        y = F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        return y if residual is None else (y, residual)
