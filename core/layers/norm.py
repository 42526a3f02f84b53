"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.hidden_size = hidden_size

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Normalise ``x`` (after adding ``residual``). Returns ``y`` or ``(y, new_residual)``."""
        if residual is not None:
            x = x + residual
            residual = x
        # one fused kernel; it accumulates in float32 for bf16/fp16 inputs
        y = F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        return y if residual is None else (y, residual)
