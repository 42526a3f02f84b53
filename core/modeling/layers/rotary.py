"""Rotary position embeddings (the "rotate half" layout of HF Llama) and their scalings.

Scalings (``rope_type`` of an HF config): ``default``, ``linear``, ``dynamic`` (NTK), ``llama3``, ``yarn`` and
``longrope``; a ``partial_rotary_factor`` below 1 rotates only the first part of each head. pagoda serves at
most ``max_position_embeddings`` positions, so ``dynamic`` is the unscaled RoPE (transformers rescales only past
that length), and ``longrope`` takes its ``long_factor`` when the engine's ``max_model_len`` exceeds
``original_max_position_embeddings`` and its ``short_factor`` otherwise (transformers chooses per batch by the
longest position).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from pagoda.errors import ConfigError
from pagoda.modeling.layers.fused_ops import CpuKernels

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE of a model: its base, scaling (the HF ``rope_scaling`` / ``rope_parameters`` dict, or None) and how
    much of each head it rotates. Layers with equal specs share one table."""

    theta: float
    scaling: Optional[tuple[tuple[str, Any], ...]] = None  # sorted items of the scaling dict (hashable)
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    field_name: str = field(default="rope_scaling", compare=False)

    @staticmethod
    def of(theta: float, scaling: Optional[dict[str, Any]], partial_rotary_factor: float = 1.0,
           max_position_embeddings: int = 2048, field_name: str = "rope_scaling") -> "RopeSpec":
        items = None
        if scaling:
            items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))
        return RopeSpec(float(theta), items, float(partial_rotary_factor), int(max_position_embeddings), field_name)

    @property
    def scaling_dict(self) -> dict[str, Any]:
        return dict(self.scaling or ())

    @property
    def rope_type(self) -> str:
        s = self.scaling_dict
        return s.get("rope_type") or s.get("type") or "default"


def rope_from_hf(cfg: dict[str, Any], layer_type: Optional[str] = None, theta_key: str = "rope_theta",
                 default_theta: float = 10000.0) -> RopeSpec:
    """The RoPE an HF text config asks for, from either spelling: ``rope_theta`` + ``rope_scaling`` (transformers 4)
    or ``rope_parameters`` (transformers 5; per layer type where the model has several, as Gemma 3)."""
    params = cfg.get("rope_parameters") or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    scaling = cfg.get("rope_scaling")
    if layer_type is not None and isinstance(scaling, dict) and isinstance(scaling.get(layer_type), dict):
        scaling = scaling[layer_type]
    if not scaling and params.get("rope_type", "default") not in ("default", None):
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling and cfg.get("original_max_position_embeddings") and (
            scaling.get("rope_type") or scaling.get("type")) in ("llama3", "yarn", "longrope"):
        # a top-level original_max_position_embeddings (Phi-3's place for it) wins, as in transformers
        scaling = {**scaling, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    theta = params.get("rope_theta") or cfg.get(theta_key) or default_theta
    partial = float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    field_name = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    return RopeSpec.of(theta, scaling, partial, int(cfg.get("max_position_embeddings") or 2048), field_name)


def _yarn(inv_freq_base: torch.Tensor, dim: int, theta: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor,
                                                                                                          float]:
    factor = s.get("factor")
    orig = int(s.get("original_max_position_embeddings") or max_pos)
    if factor is None:
        factor = max_pos / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by factor
    inv_freq = inv_freq_base / factor * (1 - extrapolate) + inv_freq_base * extrapolate
    return inv_freq, float(attention_factor)


def inv_freq_and_scale(spec: RopeSpec, rotary_dim: int, max_model_len: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies of ``spec`` over ``rotary_dim`` dims, and the factor cos and sin are multiplied by."""
    theta = spec.theta
    s = spec.scaling_dict
    rope_type = spec.rope_type
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(s["factor"]), 1.0
    if rope_type == "dynamic":
        # scaled only past max_position_embeddings, which max_model_len never exceeds
        return inv_freq, 1.0
    if rope_type == "llama3":
        factor = float(s["factor"])
        low_freq_factor = float(s["low_freq_factor"])
        high_freq_factor = float(s["high_freq_factor"])
        old_len = float(s["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, rotary_dim, theta, s, spec.max_position_embeddings)
    if rope_type == "longrope":
        orig = int(s.get("original_max_position_embeddings") or spec.max_position_embeddings)
        factor = s.get("factor")
        if factor is None or "original_max_position_embeddings" not in s:
            factor = spec.max_position_embeddings / orig
        attention_factor = s.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        ext = s["long_factor"] if max_model_len > orig else s["short_factor"]
        if len(ext) != rotary_dim // 2:
            raise ConfigError(f"{spec.field_name}: longrope factors have {len(ext)} entries; the model's rotary "
                              f"dimension {rotary_dim} needs {rotary_dim // 2}")
        ext_t = torch.tensor(ext, dtype=torch.float32)
        return 1.0 / (ext_t * theta ** exponents), float(attention_factor)
    raise ConfigError(f"{spec.field_name}: rope type {rope_type!r} is not supported (supported: "
                      f"{', '.join(ROPE_TYPES)})")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given each token's position (to the first ``rotary_dim`` dims of each head)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: Optional[dict[str, Any]],
                 dtype: torch.dtype, kernels: Optional[CpuKernels] = None, spec: Optional[RopeSpec] = None,
                 max_model_len: Optional[int] = None) -> None:
        """``kernels``: the model's CPU kernels (None: torch ops). ``spec`` (instead of ``theta`` and ``scaling``):
        the RoPE with its partial rotary factor. ``max_model_len`` (default ``max_position``): the longest sequence
        the engine serves, which picks LongRoPE's factors."""
        super().__init__()
        self.kernels = kernels or CpuKernels()
        if spec is None:
            spec = RopeSpec.of(theta, scaling, 1.0, max_position)
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * spec.partial_rotary_factor)
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ConfigError(f"partial_rotary_factor {spec.partial_rotary_factor} of head_dim {head_dim} gives "
                              f"{self.rotary_dim} rotary dims; it must be a positive even number")
        inv_freq, attention_factor = inv_freq_and_scale(spec, self.rotary_dim, max_model_len or max_position)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, rotary_dim]
        self.register_buffer("cos_cache", (emb.cos() * attention_factor).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * attention_factor).to(dtype), persistent=False)

    @property
    def partial(self) -> bool:
        return self.rotary_dim != self.head_dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-step lookup, shared by every layer: two ``[num_tokens, 1, rotary_dim]`` tensors."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    def at(self, positions: torch.Tensor) -> "StepRotary":
        """What every layer of one step needs to rotate its q and k."""
        return StepRotary(self, positions)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, 1, rotary_dim] (rotary_dim <= head_dim)
        rot = cos.shape[-1]
        if rot != x.shape[-1]:
            return torch.cat((RotaryEmbedding.apply(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        rotated = torch.cat((-x2, x1), dim=-1)
        return x * cos + rotated * sin


class StepRotary:
    """One step's rotary embedding, shared by every layer: the fused CPU kernel, or cos/sin looked up once."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.rotary = rotary
        # the tables read once a step here, not through nn.Module.__getattr__ in every layer
        self.cos_cache, self.sin_cache = rotary.cos_cache, rotary.sin_cache
        self.ops = None if rotary.partial else rotary.kernels.for_tensor(self.cos_cache)
        self.positions = positions
        # int64 positions [T], as the fused kernels take them
        self.kernel_positions = positions.to(torch.int64).contiguous()
        if self.ops is not None:
            self.positions = self.kernel_positions
        else:
            self.cos, self.sin = rotary.cos_sin(positions)

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated ``q [T, H, D]`` and ``k [T, Hkv, D]`` (new tensors; torch ops)."""
        if not hasattr(self, "cos"):
            self.cos, self.sin = self.rotary.cos_sin(self.positions)
        return RotaryEmbedding.apply(q, self.cos, self.sin), RotaryEmbedding.apply(k, self.cos, self.sin)

    def kernel_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin, positions) as the fused CPU kernels take them (cos/sin ``[max_position, D]``, int64
        positions ``[T]``)."""
        return self.cos_cache, self.sin_cache, self.kernel_positions

    def split_qkv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
        """``qkv [T, (H + 2 Hkv) * D]`` -> rotated ``q [T, H, D]``, ``k [T, Hkv, D]`` and ``v [T, Hkv, D]``.

        The fused kernel rotates ``qkv`` in place (it is the projection's fresh output).
        """
        fused = self.ops is not None and qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.dtype == self.cos_cache.dtype
        if fused:
            self.ops.rotary_(qkv, self.cos_cache, self.sin_cache, self.positions, num_heads + num_kv_heads, head_dim)
        q, k, v = split_heads(qkv, num_heads, num_kv_heads, head_dim)
        if not fused:
            q, k = self.rotate(q, k)
        return q, k, v


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """``qkv [T, (H + 2 Hkv) * D]`` -> views ``q [T, H, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, D]``."""
    # one view and one split (two tensor ops, not four): the same views as splitting the rows first
    return qkv.view(qkv.shape[0], -1, head_dim).split_with_sizes((num_heads, num_kv_heads, num_kv_heads), 1)
