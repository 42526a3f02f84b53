"""fp8 (e4m3) KV cache helpers shared by the attention backends.

A layer's K and V each have one scale (``layer.k_scale`` / ``layer.v_scale``, 1.0 unless the
checkpoint carries them): the cache stores ``clamp(k / k_scale, +-448)`` as float8_e4m3fn and a
reader takes ``float(stored) * k_scale``. The backends fold the scales instead of multiplying
K/V: ``k_scale`` into the softmax scale, ``v_scale`` into the attention output.
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.config import CacheConfig, ModelConfig
from pagoda.host.dtypes import is_fp8_kv_cache, resolve_kv_cache_dtype

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def kv_cache_dtype_for(model_config: ModelConfig, cache_config: CacheConfig) -> torch.dtype:
    """The storage dtype a backend allocates its cache in (the engine sizes blocks by it)."""
    return resolve_kv_cache_dtype(_requested(cache_config), model_config.dtype)


def uses_fp8(cache_config: CacheConfig) -> bool:
    return is_fp8_kv_cache(_requested(cache_config))


def _requested(cache_config: CacheConfig) -> str:
    # a hand-built config (kernel benchmarks, tests) may name only the block size
    return getattr(cache_config, "kv_cache_dtype", "auto")


def kv_scales(layer: Any) -> tuple[float, float]:
    """(k_scale, v_scale) of an attention layer; 1.0 for layers that carry none."""
    return float(getattr(layer, "k_scale", 1.0)), float(getattr(layer, "v_scale", 1.0))


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Any float tensor -> float8_e4m3fn of ``x / scale``, saturated to +-448 (round to nearest even)."""
    if scale != 1.0:
        x = x.float() / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def widen_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn -> ``dtype`` (bf16, fp16 or fp32), exact.

    On a CPU torch casts fp8 one element at a time; here the magnitude bits move into an fp16 (value
    times 2^-8, subnormals included, sign to bit 15) with vectorised integer ops: ~2.5x faster.
    """
    if x.device.type != "cpu":
        return x.to(dtype)
    codes = x.view(torch.uint8).to(torch.int16)
    half_bits = (codes & 0x7F).bitwise_left_shift_(7).bitwise_or_((codes & 0x80).bitwise_left_shift_(8))
    return half_bits.view(torch.float16).to(dtype).mul_(256)


def dequantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn -> ``dtype`` values ``float(x) * scale`` (exact for scale 1 in bf16/fp16/fp32)."""
    if scale == 1.0:
        return widen_fp8(x, dtype)
    return (widen_fp8(x, torch.float32) * scale).to(dtype)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor seen as uint8 (same bytes): CPU index_copy_/index_select have no fp8 kernels."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t
