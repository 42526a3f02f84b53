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
        # computed in float32 as the reference implementation does, then cast back
        y = F.rms_norm(x.float(), (self.hidden_size,), eps=self.eps).to(x.dtype) * self.weight
        return y if residual is None else (y, residual)
