"""MXFP4 checkpoints (``quant_method: mxfp4``), as gpt-oss is published.

Only the routed experts are quantized; attention, routers, embeddings and the LM head are stored in bf16
(the config's ``modules_to_not_convert``), so :meth:`Mxfp4Config.for_layer` leaves every linear layer dense.
Each expert projection is stored as two tensors:

- ``*_blocks`` uint8 ``[E, out, in / 32, 16]``: 32 4-bit values per block of 32 input columns, two per
  byte, the low nibble first; a value is an FP4 (e2m1) number, ``FP4_VALUES[nibble]``;
- ``*_scales`` uint8 ``[E, out, in / 32]``: each block's power-of-two scale as a biased exponent (E8M0,
  bias 127).

``W[e, o, i] = FP4_VALUES[nibble] * 2 ** (scale - 127)``. The experts stay in this form
(:class:`Mxfp4MoeMethod`): the codes move into the int runtime layout of ``int_moe.py`` (two per byte, a row's
first half in the low nibbles), the exponents stay one byte per 32 weights, and the int kernel's MoE call
computes from them, an FP4 value table in place of the integers (``cpu_int_kernels.cpp``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagoda.errors import CheckpointError, ConfigError
from pagoda.host.env import host_config_of
from pagoda.plugins.quant.base import kernel_for_device
from pagoda.plugins.quant.int_moe import CODES_FP4, ExpertInts, IntMoeMethod
from pagoda.plugins.quant.packing import unpack_uint8

# the 16 values of FP4 (e2m1), indexed by the 4-bit code: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # input columns per scale


class Mxfp4Config:
    """Parsed MXFP4 ``quantization_config``; it quantizes no linear layer of pagoda's, only the experts."""

    def __init__(self, model_config: Any, cfg: dict[str, Any]) -> None:
        if cfg.get("quant_method") != "mxfp4":
            raise ConfigError("mxfp4 reads checkpoints published in MXFP4 (quantization_config.quant_method "
                              "'mxfp4'); it does not quantize a dense checkpoint while loading: drop --quantization "
                              "mxfp4, or use --quantization int8|fp8")
        self.modules_to_not_convert = list(cfg.get("modules_to_not_convert") or [])
        # the engine's host settings: its quant_kernel, and the ISA level its C++ kernel is built for
        self.host = host_config_of(model_config)
        self.kernel = kernel_for_device(self.host.quant_kernel)

    def for_layer(self, prefix: str) -> None:
        return None

    def moe_method(self, prefix: str) -> "Mxfp4MoeMethod":
        """The routed experts under ``prefix`` (every MoE layer's) kept in MXFP4."""
        return Mxfp4MoeMethod(self.kernel, self.host)


class Mxfp4MoeMethod(IntMoeMethod):
    """MXFP4 experts held packed: ``w13_q`` / ``w2_q`` uint8 as :class:`IntMoeMethod` holds 4-bit codes, and
    ``w13_scales`` / ``w2_scales`` uint8 ``[E, rows, in / 32]`` E8M0 exponents, no zero points (about 0.27x the
    bytes of bf16 experts). The checkpoint tensors of one projection arrive as ``{"blocks", "scales"}``."""

    has_zeros = False
    codes = CODES_FP4

    def __init__(self, kernel: str, host: Optional[Any]) -> None:
        super().__init__(4, BLOCK, unpack_mxfp4, kernel, host, "MXFP4")

    def scale_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def dequantize(self, layer: nn.Module, name: str, experts: torch.Tensor, in_features: int,
                   dtype: torch.dtype) -> torch.Tensor:
        q = getattr(layer, f"{name}_q")[experts]  # [n, rows, in / 2]
        exponents = getattr(layer, f"{name}_scales")[experts]  # [n, rows, in / 32]
        n, rows, groups = exponents.shape
        values = fp4_values(unpack_uint8(q.reshape(n * rows, -1), 4).view(n, rows, groups, BLOCK))
        return torch.ldexp(values, exponents.to(torch.int32)[..., None] - 127).view(n, rows, -1).to(dtype)

    def describe(self) -> str:
        return "MXFP4"


def fp4_values(codes: torch.Tensor) -> torch.Tensor:
    """FP4 codes (uint8, 0 to 15) as their float32 values."""
    return torch.tensor(FP4_VALUES, device=codes.device)[codes.long()]


def unpack_mxfp4(tensors: dict[str, torch.Tensor], name: str) -> ExpertInts:
    """One expert projection's ``blocks [out, in / 32, 16]`` and ``scales [out, in / 32]`` as (FP4 codes
    ``[out, in]`` in column order, E8M0 exponents ``[out, in / 32]``, no zero points)."""
    blocks, scales = tensors["blocks"], tensors["scales"]
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 tensors {name}_blocks / {name}_scales are {blocks.dtype} / {scales.dtype}; "
                              "expected uint8 (packed FP4 codes and E8M0 exponents)")
    if blocks.dim() != 3 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(f"MXFP4 tensors {name}_blocks and {name}_scales hold {tuple(blocks.shape)} and "
                              f"{tuple(scales.shape)} per expert, which do not fit together: expected [out, in / 32, "
                              "16] and [out, in / 32]")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1)  # [out, G, 16, 2]: the low nibble first
    return codes.reshape(blocks.shape[0], -1), scales, None, None
