"""AWQ: 4-bit group-wise weights with zero points, in the "GEMM" layout AutoAWQ writes.

Checkpoint tensors per linear (``in``/``out`` features, ``g`` the group size):
``qweight`` int32 ``[in, out / 8]`` and ``qzeros`` int32 ``[in / g, out / 8]``,
both packed along the output dimension in AWQ's interleaved nibble order, and
``scales`` fp16 ``[in / g, out]``. ``W[i, o] = (q[i, o] - z[i // g, o]) * s[i // g, o]``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagoda.errors import ConfigError
from pagoda.host.env import host_config_of
from pagoda.plugins.quant.base import (
    add_param, check_group_size, config_value, drop_params, is_skipped, kernel_for_device, output_sharded_loader)
from pagoda.plugins.quant.int_linear import (IntPart, apply_int_linear, dequantize_expert, install_int_weight,
                                             unpack_expert)
from pagoda.plugins.quant.int_moe import IntMoeMethod
from pagoda.plugins.quant.packing import unpack_awq


class AWQConfig:
    """Parsed ``quantization_config`` (``quant_method: awq``) or AutoAWQ's ``quant_config.json``."""

    def __init__(self, model_config: Any, cfg: dict[str, Any]) -> None:
        self.bits = config_value(cfg, ("bits", "w_bit"), 4)
        self.group_size = check_group_size(config_value(cfg, ("group_size", "q_group_size"), 128), "AWQ")
        self.version = str(cfg.get("version", "gemm")).lower()
        if self.bits != 4:
            raise ConfigError(f"AWQ with bits={self.bits} is not supported; AWQ checkpoints are 4-bit (bits: 4)")
        if self.version != "gemm":
            raise ConfigError(
                f"AWQ version {cfg.get('version')!r} is not supported; pagoda reads the 'gemm' layout (AutoAWQ's "
                "default); re-export the model with version='GEMM'"
            )
        if not cfg.get("zero_point", True):
            raise ConfigError("AWQ without zero points (zero_point: false) is not supported; use zero_point: true")
        self.modules_to_not_convert = list(cfg.get("modules_to_not_convert") or [])
        # the engine's host settings: its quant_kernel, and the ISA level its C++ kernel is built for
        self.host = host_config_of(model_config)
        self.kernel = kernel_for_device(self.host.quant_kernel)

    def dequantize(self, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """One packed projection (an MoE expert's) as float32 ``[out, in]``."""
        return dequantize_expert(self, tensors, name)

    def moe_method(self, prefix: str) -> Optional[IntMoeMethod]:
        """The routed experts under ``prefix`` (the layer's MLP) kept packed and computed from the packed bits
        (None when ``modules_to_not_convert`` leaves them unquantized)."""
        if any(k in f"{prefix}.experts.0.gate_proj" for k in self.modules_to_not_convert):
            return None
        return IntMoeMethod(4, self.group_size, self.expert_ints, self.kernel, self.host, "AWQ")

    def expert_ints(self, tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, ...]:
        """One packed expert projection as (q ``[out, in]``, scales, zeros ``[out, groups]``, g_idx)."""
        return unpack_expert(self, tensors, name)

    def for_layer(self, prefix: str) -> Optional["AWQLinearMethod"]:
        # AutoAWQ skips a module when any listed fragment occurs in its name
        if is_skipped(prefix, lambda m: any(k in m for k in self.modules_to_not_convert), "AWQ"):
            return None
        return AWQLinearMethod(self)


class AWQLinearMethod:
    def __init__(self, config: AWQConfig) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        n_in, n_out = layer.in_features, layer.out_features
        group = n_in if self.config.group_size == -1 else self.config.group_size
        if n_in % group or n_out % 8:
            raise ConfigError(
                f"{layer.prefix}: AWQ needs in_features ({n_in}) divisible by group_size {group} and out_features "
                f"({n_out}) divisible by 8; this model cannot be loaded with this AWQ config"
            )
        layer.quant_dtype, layer.awq_group = dtype, group
        # input features per row of the group tensors (None: one group spans the whole input, every rank's)
        per_group = None if self.config.group_size == -1 else group
        add_param(layer, "qweight", (n_in, n_out // 8), torch.int32,
                  output_sharded_loader(layer, "AWQ", out_dim=1, pack=8, expected_dtype=torch.int32, in_pack=1))
        add_param(layer, "qzeros", (n_in // group, n_out // 8), torch.int32,
                  output_sharded_loader(layer, "AWQ", out_dim=1, pack=8, expected_dtype=torch.int32,
                                        in_pack=per_group))
        # float32 holds fp16 and bf16 scales exactly until they are converted to the model dtype
        add_param(layer, "scales", (n_in // group, n_out), torch.float32,
                  output_sharded_loader(layer, "AWQ", out_dim=1, in_pack=per_group))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_awq(layer.qweight.data).t()  # [out, in]
        zeros = unpack_awq(layer.qzeros.data).t()  # [out, groups]
        scales = layer.scales.data.t()  # [out, groups]
        drop_params(layer, "qweight", "qzeros", "scales")
        install_int_weight(layer, q, scales, zeros, 4, layer.awq_group, [IntPart(0, layer.out_features, None)],
                           self.config.kernel, self.config.host)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return apply_int_linear(layer, x, bias)
