"""The attention layer: projections are the model's; K/V storage and the kernel are the backend's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache and attends, through the selected backend."""

    def __init__(self, backend: Any, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float) -> None:
        super().__init__()
        self.backend = backend
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, metadata: Any) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        return self.backend.forward(self, q, k, v, kv_cache, metadata)
