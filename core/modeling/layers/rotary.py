"""Rotary position embeddings (the "rotate half" layout of HF Llama), with Llama 3 / linear scaling."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from pagoda.errors import ConfigError
from pagoda.modeling.layers.fused_ops import CpuKernels


def _inv_freq(head_dim: int, theta: float, scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ConfigError(f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given each token's position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: Optional[dict[str, Any]],
                 dtype: torch.dtype, kernels: Optional[CpuKernels] = None) -> None:
        """``kernels``: the model's CPU kernels (None: torch ops)."""
        super().__init__()
        self.kernels = kernels or CpuKernels()
        self.head_dim = head_dim
        inv_freq = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos_cache", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cache", emb.sin().to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-step lookup, shared by every layer: two ``[num_tokens, 1, head_dim]`` tensors."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    def at(self, positions: torch.Tensor) -> "StepRotary":
        """What every layer of one step needs to rotate its q and k."""
        return StepRotary(self, positions)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, num_heads, head_dim]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        rotated = torch.cat((-x2, x1), dim=-1)
        return x * cos + rotated * sin


class StepRotary:
    """One step's rotary embedding, shared by every layer: the fused CPU kernel, or cos/sin looked up once."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.rotary = rotary
        self.ops = rotary.kernels.for_tensor(rotary.cos_cache)
        if self.ops is not None:
            self.positions = positions.to(torch.int64).contiguous()
        else:
            self.cos, self.sin = rotary.cos_sin(positions)

    def split_qkv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
        """``qkv [T, (H + 2 Hkv) * D]`` -> rotated ``q [T, H, D]``, ``k [T, Hkv, D]`` and ``v [T, Hkv, D]``.

        The fused kernel rotates ``qkv`` in place (it is the projection's fresh output).
        """
        fused = (self.ops is not None and qkv.dim() == 2 and qkv.stride(1) == 1
                 and qkv.dtype == self.rotary.cos_cache.dtype)
        if fused:
            self.ops.rotary_(qkv, self.rotary.cos_cache, self.rotary.sin_cache, self.positions,
                             num_heads + num_kv_heads, head_dim)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = q.view(-1, num_heads, head_dim)
        k, v = k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)
        if not fused:
            if not hasattr(self, "cos"):
                self.cos, self.sin = self.rotary.cos_sin(self.positions)
            q, k = RotaryEmbedding.apply(q, self.cos, self.sin), RotaryEmbedding.apply(k, self.cos, self.sin)
        return q, k, v
