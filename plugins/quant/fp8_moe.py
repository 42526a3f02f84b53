"""FP8 (float8_e4m3fn) routed experts kept as one byte a weight: the experts of a compressed-tensors checkpoint
(float-quantized) or of a ``quant_method: fp8`` one (``weight_scale_inv`` per block of ``weight_block_size``, or one
``weight_scale`` per module) held in the int runtime layout of ``int_moe.py`` (8-bit codes) with their scales per
output row (the "channel" and "tensor" strategies) or per block of input columns ("block"), and computed from the
bytes by the int kernel's MoE call, each code read as the e4m3 number it encodes (``cpu_int_kernels.cpp``).

``W[e, o, i] = fp8(q[e, o, i]) * scale[e, o, i // group]``, the scales held in float32 as the checkpoint stores
them (a bf16 scale would keep 8 of their 24 bits of mantissa), no zero points.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagoda.errors import CheckpointError, ConfigError
from pagoda.plugins.quant.int_moe import CODES_FP8, ExpertInts, IntMoeMethod

FP8 = torch.float8_e4m3fn


class Fp8MoeMethod(IntMoeMethod):
    """FP8 experts: ``w13_q`` / ``w2_q`` uint8 ``[E, rows, in]`` (the weights' bits), ``w13_scales`` / ``w2_scales``
    float32 ``[E, rows, groups]`` (one group per row, or ``group_size`` columns). ``scale_name``: the checkpoint's
    scale tensor (``weight_scale``, or ``weight_scale_inv`` in ``quant_method: fp8`` block checkpoints)."""

    has_zeros = False
    codes = CODES_FP8

    def __init__(self, group_size: int, block_rows: int, kernel: str, host: Optional[Any], method: str,
                 scale_name: str = "weight_scale") -> None:
        super().__init__(8, group_size, self.expert_codes, kernel, host, method)
        self.block_rows = block_rows  # output rows a scale covers (block strategy), else 1
        self.scale_name = scale_name

    def scale_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def expert_codes(self, tensors: dict[str, torch.Tensor], name: str) -> ExpertInts:
        """One expert projection's ``weight`` (fp8 ``[out, in]``) and its scale (one, one per row, or
        ``[ceil(out / rows), ceil(in / cols)]`` per block) as (codes, scales ``[out, groups]``, no zero points)."""
        missing = [t for t in ("weight", self.scale_name) if t not in tensors]
        if missing:
            raise CheckpointError(f"quantized expert {name!r} ({self.method}) has no {', '.join(missing)} tensor(s)")
        weight, scale = tensors["weight"], tensors[self.scale_name].float()
        if weight.dtype != FP8:
            raise CheckpointError(f"quantized expert {name!r}: weight is {weight.dtype}; {self.method} expects "
                                  "float8_e4m3fn")
        n_out, n_in = weight.shape
        if self.group_size == -1:
            if scale.numel() not in (1, n_out):
                raise CheckpointError(f"quantized expert {name!r}: {self.scale_name} {tuple(scale.shape)} is neither "
                                      f"one scale nor one per output row of weight {tuple(weight.shape)}")
            scales = scale.reshape(-1, 1).expand(n_out, 1)
        else:
            blocks = (-(-n_out // self.block_rows), -(-n_in // self.group_size))
            if tuple(scale.shape) != blocks:
                raise CheckpointError(f"quantized expert {name!r}: {self.scale_name} {tuple(scale.shape)} does not "
                                      f"cover weight {tuple(weight.shape)} in blocks of {self.block_rows} x "
                                      f"{self.group_size}: expected {blocks}")
            scales = scale.repeat_interleave(self.block_rows, 0)[:n_out]
        return weight.view(torch.uint8), scales, None, None

    def dequantize(self, layer: nn.Module, name: str, experts: torch.Tensor, in_features: int,
                   dtype: torch.dtype) -> torch.Tensor:
        q = getattr(layer, f"{name}_q")[experts]  # [n, rows, groups * group]
        scales = getattr(layer, f"{name}_scales")[experts]  # [n, rows, groups] float32
        n, rows, groups = scales.shape
        w = q.view(FP8).float().view(n, rows, groups, -1) * scales.unsqueeze(-1)
        return w.view(n, rows, -1)[:, :, :in_features].to(dtype)

    def describe(self) -> str:
        return "FP8"


def fp8_moe_method(where: str, weights: dict[str, Any], kernel: str, host: Optional[Any]) -> Fp8MoeMethod:
    """The experts method of a compressed-tensors FP8 config group (``weights``: its weights scheme)."""
    strategy = weights.get("strategy")
    if weights.get("num_bits") != 8 or strategy not in ("tensor", "channel", "block"):
        raise ConfigError(f"{where}: FP8 experts with weights {weights} are not supported; expected num_bits 8 and "
                          "strategy tensor, channel or block")
    if strategy != "block":
        return Fp8MoeMethod(-1, 1, kernel, host, "compressed-tensors FP8")
    rows, cols = (int(v) for v in weights.get("block_structure") or (0, 0))
    if rows < 1 or cols < 1:
        raise ConfigError(f"{where}: FP8 block strategy without a block_structure [rows, cols]")
    return Fp8MoeMethod(cols, rows, kernel, host, "compressed-tensors FP8")
