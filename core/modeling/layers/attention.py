"""The attention layer: projections are the model's; K/V storage and the kernel are the backend's."""

from __future__ import annotations

import math
import re
from typing import Any, Optional

import torch
from torch import nn

from pagoda.errors import CheckpointError
from pagoda.step import PoolMetadata

# per-layer fp8 KV scales as llm-compressor / vLLM checkpoints name them ("kv_scale" is the older
# single scale for both; AutoFP8 wrote k_proj/v_proj "output_scale")
_KV_SCALE_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
                            r"v_proj\.output_scale)$")


def kv_scale_target(name: str) -> Optional[tuple[int, str]]:
    """(layer index, scale name) when a checkpoint tensor is a KV cache scale, else None."""
    match = _KV_SCALE_NAME.search(name)
    return (int(match.group(1)), match.group(2)) if match else None


# what a layer may ask of its attention backend beyond plain causal attention (a backend's
# ``attention_features`` lists those it implements)
ATTENTION_FEATURES = ("sliding_window", "logit_softcap", "sinks")


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache and attends, through the selected backend.

    Each query attends causally to its sequence's keys, scores times ``scale``; a layer may further ask for
    ``sliding_window`` (a query at position p sees keys at positions > p - window: the window counts the
    query's own token), ``logit_softcap`` (scores become ``cap * tanh(score / cap)`` before the softmax) and
    ``sinks`` (one learned logit per query head joins the softmax's denominator and attends to nothing; the
    parameter ``sinks [num_heads]`` of this rank's heads, loaded from the checkpoint).
    """

    def __init__(self, backend: Any, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                 sinks: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.backend = backend
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = int(sliding_window) if sliding_window else None
        self.logit_softcap = float(logit_softcap) if logit_softcap else None
        self.sinks = None
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=dtype), requires_grad=False)
        # fp8 KV cache: the cache stores k / k_scale and v / v_scale (per tensor; 1.0 unless the
        # checkpoint carries them). Plain floats: a backend reads them on every call without a sync.
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def features(self) -> set[str]:
        """Which of ``ATTENTION_FEATURES`` this layer uses."""
        return {name for name, on in (("sliding_window", self.sliding_window), ("logit_softcap", self.logit_softcap),
                                      ("sinks", self.sinks is not None)) if on}

    def load_kv_scale(self, which: str, tensor: torch.Tensor, name: str) -> None:
        """Set k_scale / v_scale (or both, for ``kv_scale``) from a one-element checkpoint tensor."""
        value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else math.nan
        if tensor.numel() != 1 or not math.isfinite(value) or value <= 0:
            raise CheckpointError(
                f"KV cache scale {name!r} must be one positive finite number (a per-tensor scale), got shape "
                f"{tuple(tensor.shape)}" + (f" value {value}" if tensor.numel() == 1 else "")
            )
        if which in ("k_scale", "kv_scale", "k_proj.output_scale"):
            self.k_scale = value
        if which in ("v_scale", "kv_scale", "v_proj.output_scale"):
            self.v_scale = value

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, metadata: Any) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        if isinstance(metadata, PoolMetadata):  # the window pool is on: a layer with a window reads its slots
            metadata = metadata.window if self.sliding_window else metadata.full
        return self.backend.forward(self, q, k, v, kv_cache, metadata)
