"""Numeric types: the dtype names pagoda accepts, what ``dtype auto`` becomes on this machine, and how
the KV cache is stored."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from pagoda.errors import ConfigError
from pagoda.host.cpu_isa import cpu_isa

if TYPE_CHECKING:
    from pagoda.interfaces import AttentionBackend

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def cpu_has_bf16(isa_cap: Optional[str] = None) -> bool:
    """True when this CPU multiplies bf16 natively (AVX-512 BF16), unless ``isa_cap`` (default: the
    ``cpu_isa`` host setting) caps it lower."""
    return cpu_isa(isa_cap) == "avx512_bf16"


def cpu_runs_bf16_fast(isa_cap: Optional[str] = None, fused_cpu_ops: bool = True) -> bool:
    """True when bf16 weights are the fast choice on this CPU: it multiplies bf16 natively, or it has
    AVX2 and pagoda's fused kernels widen bf16 to fp32 in registers (half the bytes per decode step;
    without those kernels torch's bf16 matmul is far slower than fp32 there)."""
    return cpu_has_bf16(isa_cap) or (fused_cpu_ops and cpu_isa(isa_cap) != "generic")


# fp8 KV cache formats: name -> storage dtype. e4m3 (range +-448, 3 mantissa bits) with a per-layer scale.
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
KV_CACHE_DTYPE_CHOICES = ("auto", *FP8_KV_CACHE_DTYPES, *_DTYPES)


def is_fp8_kv_cache(kv_cache_dtype: str) -> bool:
    """True when K/V are stored as fp8 (scaled e4m3) rather than in the model dtype."""
    return kv_cache_dtype in FP8_KV_CACHE_DTYPES


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the KV cache: fp8 e4m3 for ``fp8``/``fp8_e4m3``, the model dtype otherwise.

    A float name that is not the model's dtype is refused: K/V are produced in the model dtype and
    the backends store them either as they are or as scaled fp8.
    """
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return FP8_KV_CACHE_DTYPES[kv_cache_dtype]
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _DTYPES:
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of "
                          f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")
    if _DTYPES[kv_cache_dtype] != model_dtype:
        model_name = str(model_dtype).removeprefix("torch.")
        raise ConfigError(
            f"kv_cache_dtype {kv_cache_dtype!r} differs from the model dtype {model_name}; K/V are stored in the "
            f"model dtype or as fp8, so pass --kv-cache-dtype auto (or {model_name}) or fp8"
        )
    return model_dtype


def resolve_dtype(dtype: str | torch.dtype, isa_cap: Optional[str] = None, fused_cpu_ops: bool = True) -> torch.dtype:
    """The torch dtype of a dtype name; ``auto`` asks the GPU, or the CPU (capped to ``isa_cap``).

    ``auto`` is bf16 on a GPU and on a CPU with AVX2 or more (natively with AVX-512 BF16, widened in
    registers by the fused kernels on AVX2), float32 below AVX2 or with the fused CPU kernels off.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.cuda.is_available() or cpu_runs_bf16_fast(isa_cap, fused_cpu_ops):
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of auto, float32, bfloat16, float16")
    return _DTYPES[dtype]


def stored_kv_dtype(backend: "AttentionBackend", model_dtype: torch.dtype) -> torch.dtype:
    """The dtype an attention backend's cache tensors hold: its ``kv_cache_dtype``, None meaning the model's.

    ``kv_cache_dtype`` is an optional member of ``pagoda.interfaces.AttentionBackend``: a backend built by pagoda
    (``pagoda.registry.adapt.adapt_component``) that lacks it has None, the model's dtype.
    """
    return backend.kv_cache_dtype or model_dtype
