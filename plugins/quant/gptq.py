"""GPTQ in the classic layout AutoGPTQ and GPTQModel write (``quantize_config.json``).

Checkpoint tensors per linear (``b`` bits, ``g`` the group size, ``G = ceil(in / g)``):
``qweight`` int32 ``[in * b / 32, out]`` packed along the input dimension,
``qzeros`` int32 ``[G, out * b / 32]`` packed along the output dimension,
``scales`` fp16 ``[G, out]`` and ``g_idx`` int32 ``[in]`` (each input
column's group; a permutation of groups under ``desc_act``).
``W[i, o] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o]`` where the v1 format
(``checkpoint_format: gptq``, the default) stores every zero point minus one.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
from torch import nn

from pagoda.errors import CheckpointError, ConfigError
from pagoda.host.env import host_config_of
from pagoda.plugins.quant.base import (
    add_param, check_group_size, drop_params, is_skipped, kernel_for_device, loaded_suffix,
    output_sharded_loader, per_shard_loader, shard_rows)
from pagoda.plugins.quant.int_linear import (apply_int_linear, dequantize_expert, install_int_weight,
                                             parts_from_g_idx, unpack_expert)
from pagoda.plugins.quant.int_moe import IntMoeMethod, packs_act_order
from pagoda.plugins.quant.packing import unpack_int32


class GPTQConfig:
    """Parsed GPTQ ``quantization_config`` / ``quantize_config.json``."""

    def __init__(self, model_config: Any, cfg: dict[str, Any]) -> None:
        self.bits = cfg.get("bits", 4)
        if self.bits not in (4, 8):
            raise ConfigError(f"GPTQ with bits={self.bits!r} is not supported; pagoda reads 4-bit and 8-bit GPTQ")
        self.group_size = check_group_size(cfg.get("group_size", 128), "GPTQ")
        self.desc_act = bool(cfg.get("desc_act", False))
        self.sym = bool(cfg.get("sym", True))
        fmt = str(cfg.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ConfigError(f"GPTQ checkpoint_format {fmt!r} is not supported; expected 'gptq' or 'gptq_v2'")
        self.zero_offset = 1 if fmt == "gptq" else 0  # v1 stores zero points minus one
        # GPTQModel's per-module overrides: "-:regex" leaves matching modules unquantized
        dynamic = cfg.get("dynamic") or {}
        self.skip_patterns = [key[2:] for key in dynamic if key.startswith("-:")]
        overrides = [key for key in dynamic if not key.startswith("-:")]
        if overrides:
            raise ConfigError(f"GPTQ 'dynamic' per-module overrides {overrides} are not supported; only '-:' "
                              "exclusions are")
        # the engine's host settings: its quant_kernel, and the ISA level its C++ kernel is built for
        self.host = host_config_of(model_config)
        self.kernel = kernel_for_device(self.host.quant_kernel)

    def dequantize(self, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """One packed projection (an MoE expert's) as float32 ``[out, in]``."""
        return dequantize_expert(self, tensors, name)

    def moe_method(self, prefix: str) -> Optional[IntMoeMethod]:
        """The routed experts under ``prefix`` (the layer's MLP) kept packed and computed from the packed bits, in
        act-order (``desc_act``) too, their columns sorted by ``g_idx``; None for int8 experts with row scales (the
        MoE kernel's int8 path), excluded experts, and act-order ones under tensor parallelism, which are loaded as
        before."""
        expert = f"{prefix}.experts.0.gate_proj"
        if self.int8_experts(prefix) or any(re.match(p, expert) for p in self.skip_patterns):
            return None
        if self.desc_act and not packs_act_order("GPTQ", prefix):
            return None
        return IntMoeMethod(self.bits, self.group_size, self.expert_ints, self.kernel, self.host, "GPTQ",
                            act_order=self.desc_act)

    def expert_ints(self, tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, ...]:
        """One packed expert projection as (q ``[out, in]``, scales, zeros ``[out, groups]``, g_idx ``[in]``)."""
        return unpack_expert(self, tensors, name)

    def int8_experts(self, prefix: str) -> bool:
        """8-bit, symmetric, one scale per output column (``group_size: -1``): the routed experts stay int8 in
        the MoE kernel (``prefix``, the layer's MLP, is the same for every layer: one scheme covers them all)."""
        return self.bits == 8 and self.group_size == -1 and self.sym

    def int8_expert(self, tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One routed expert's projection as (int8 ``[out, in]``, float32 scales ``[out]``), exactly the
        checkpoint's values; its zero points must all be 128, as ``sym: true`` says."""
        dequantize_expert(self, tensors, name)  # checks that the tensors fit together
        zeros = unpack_int32(tensors["qzeros"], 8, dim=1) + self.zero_offset
        if not bool((zeros == 128).all()):
            raise CheckpointError(f"quantized expert {name!r}: the config says sym: true, but its zero points are not "
                                  "all 128; fix the config (sym: false) or the checkpoint")
        q = unpack_int32(tensors["qweight"], 8, dim=0) - 128  # [in, out]
        return q.t().contiguous().to(torch.int8), tensors["scales"].float().flatten().contiguous()

    def for_layer(self, prefix: str) -> Optional["GPTQLinearMethod"]:
        if is_skipped(prefix, lambda m: any(re.match(p, m) for p in self.skip_patterns), "GPTQ"):
            return None
        return GPTQLinearMethod(self)


class GPTQLinearMethod:
    def __init__(self, config: GPTQConfig) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        bits, n_in, n_out = self.config.bits, layer.in_features, layer.out_features
        per_word = 32 // bits
        group = n_in if self.config.group_size == -1 else self.config.group_size
        num_groups = -(-n_in // group)
        if n_in % per_word or n_out % per_word:
            raise ConfigError(f"{layer.prefix}: {bits}-bit GPTQ needs in_features ({n_in}) and out_features "
                              f"({n_out}) divisible by {per_word}")
        if self.config.desc_act and getattr(layer, "tp_cols", None) is not None:
            raise ConfigError(f"{layer.prefix}: GPTQ with act-order (desc_act) is not split over input features "
                              "for tensor parallelism (each rank's columns would need every group's scales); use "
                              "tensor_parallel_size=1 or a checkpoint quantized without desc_act")
        layer.quant_dtype, layer.gptq_group = dtype, group
        # input features per row of the group tensors (None: one group spans the whole input, every rank's)
        per_group = None if self.config.group_size == -1 else group
        add_param(layer, "qweight", (n_in // per_word, n_out), torch.int32,
                  output_sharded_loader(layer, "GPTQ", out_dim=1, expected_dtype=torch.int32, in_pack=per_word))
        add_param(layer, "qzeros", (num_groups, n_out // per_word), torch.int32,
                  output_sharded_loader(layer, "GPTQ", out_dim=1, pack=per_word, expected_dtype=torch.int32,
                                        in_pack=per_group))
        add_param(layer, "scales", (num_groups, n_out), torch.float32,
                  output_sharded_loader(layer, "GPTQ", out_dim=1, in_pack=per_group))
        g_idx = add_param(layer, "g_idx", (len(layer.output_sizes), n_in), torch.int64,
                          per_shard_loader(layer, "GPTQ", per_input=True))
        g_idx.is_optional = not self.config.desc_act  # old checkpoints without act-order omit it

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        bits, group = self.config.bits, layer.gptq_group
        q = unpack_int32(layer.qweight.data, bits, dim=0).t().contiguous()  # [out, in]
        zeros = unpack_int32(layer.qzeros.data, bits, dim=1).t() + self.config.zero_offset  # [out, groups]
        scales = layer.scales.data.t()  # [out, groups]
        rows = shard_rows(layer)
        has_g_idx = loaded_suffix(layer, "g_idx")
        if self.config.desc_act and not has_g_idx:
            raise CheckpointError(f"{layer.prefix}: the config sets desc_act but the checkpoint has no g_idx tensor")
        # a row-parallel rank's g_idx counts groups from the first column of the whole layer
        # (one group spanning the whole input is group 0 on every rank)
        split = getattr(layer, "tp_cols", None) is not None and self.config.group_size != -1
        first_group = layer.tp_cols[0] // group if split else 0
        g_idx = [layer.g_idx.data[i] - first_group if has_g_idx else None for i in range(len(rows))]
        names = [f"{layer.prefix}.g_idx (shard {i})" for i in range(len(rows))]
        parts, perms = parts_from_g_idx(g_idx, rows, group, names)
        for (start, end), perm in zip(rows, perms):
            if perm is not None:
                q[start:end] = q[start:end][:, perm]
        drop_params(layer, "qweight", "qzeros", "scales", "g_idx")
        install_int_weight(layer, q, scales, zeros, bits, group, parts, self.config.kernel, self.config.host)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return apply_int_linear(layer, x, bias)
