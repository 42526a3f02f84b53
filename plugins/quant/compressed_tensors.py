"""compressed-tensors checkpoints (``quant_method: compressed-tensors``), as llm-compressor writes them.

Two formats are read:
- "pack-quantized" (W4A16 / W8A16 from GPTQ or RTN): ``weight_packed`` int32
  ``[out, in * b / 32]`` packed along the input dimension, signed values
  offset by ``2 ** (b - 1)``; ``weight_scale [out, groups]`` (``groups = 1``
  for the channel strategy); ``weight_shape [2]``; ``weight_g_idx [in]`` with
  ``actorder: group``. Symmetric only: ``W = (u - 2 ** (b - 1)) * scale``.
- "float-quantized" and, for float weights, "naive-quantized" (FP8 W8A8 /
  W8A16): ``weight`` float8_e4m3fn with ``weight_scale``; see ``fp8.py``.
- "int-quantized" (int8 W8A8 with dynamic per-token activations, or W8A16):
  ``weight`` int8 ``[out, in]`` with ``weight_scale``; see ``int8.py``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagoda.errors import CheckpointError, ConfigError
from pagoda.host.env import HostConfig, host_config_of
from pagoda.plugins.quant.base import (
    add_param, check_group_size, checkpoint_modules, drop_params, is_skipped, kernel_for_device, loaded_suffix,
    name_matches, output_sharded_loader, per_shard_loader, shard_rows)
from pagoda.plugins.quant.fp8 import Fp8LinearMethod
from pagoda.plugins.quant.fp8_moe import fp8_moe_method
from pagoda.plugins.quant.int8 import compressed_tensors_int8
from pagoda.plugins.quant.int_linear import apply_int_linear, install_int_weight, parts_from_g_idx
from pagoda.plugins.quant.int_moe import IntMoeMethod, packs_act_order
from pagoda.plugins.quant.packing import unpack_int32

# "naive-quantized" stores FP8 weights exactly like "float-quantized" (llm-compressor writes it for FP8 W8A16)
SUPPORTED_FORMATS = ("pack-quantized", "float-quantized", "naive-quantized", "int-quantized")


class CompressedTensorsConfig:
    """Parsed ``quantization_config``: ``config_groups`` of (targets, weights scheme), ``ignore`` list."""

    def __init__(self, model_config: Any, cfg: dict[str, Any]) -> None:
        self.ignore = list(cfg.get("ignore") or [])
        # the engine's host settings: its quant_kernel, and the ISA level its C++ kernel is built for
        self.host = host_config_of(model_config)
        self.kernel = kernel_for_device(self.host.quant_kernel)
        self.fp8_tables: dict = {}  # shared by every FP8 layer
        self.groups = []
        for group_name, group in (cfg.get("config_groups") or {}).items():
            fmt = group.get("format") or cfg.get("format")
            if fmt not in SUPPORTED_FORMATS:
                raise ConfigError(f"compressed-tensors format {fmt!r} (config_groups.{group_name}) is not supported; "
                                  f"pagoda reads {', '.join(SUPPORTED_FORMATS)}")
            weights = group.get("weights") or {}
            self.groups.append((group_name, list(group.get("targets") or []), fmt, weights,
                                group.get("input_activations")))
        if not self.groups:
            raise ConfigError("compressed-tensors quantization_config has no config_groups; nothing to load")

    def for_layer(self, prefix: str):
        if is_skipped(prefix, lambda m: any(name_matches(m, p) for p in self.ignore), "compressed-tensors"):
            return None
        chosen = {self._group_of(m) for m in checkpoint_modules(prefix)}
        if len(chosen) != 1:
            raise ConfigError(f"compressed-tensors config_groups {sorted(str(c) for c in chosen)} quantize the "
                              f"modules pagoda fuses into {prefix} differently; pagoda needs one scheme per layer")
        index = chosen.pop()
        if index is None:
            return None
        name, _, fmt, weights, acts = self.groups[index]
        if fmt == "pack-quantized":
            return PackedIntLinearMethod(name, weights, acts, self.kernel, self.host)
        if fmt == "int-quantized" or (fmt == "naive-quantized" and weights.get("type") == "int"):
            return compressed_tensors_int8(name, weights, acts, self.kernel, self.host)
        return _float_method(name, weights, acts, self.fp8_tables)

    def int8_experts(self, prefix: str) -> bool:
        """Whether the routed experts under ``prefix`` (``model.layers.N.mlp``) are int8 with one scale per
        output row (or per module), symmetric: those stay int8 in the MoE kernel, at half the bytes of bf16."""
        name = f"{prefix}.experts.0.gate_proj"
        index = None if any(name_matches(name, p) for p in self.ignore) else self._group_of(name)
        if index is None:
            return False
        _, _, fmt, weights, _ = self.groups[index]
        return (fmt in ("int-quantized", "pack-quantized", "naive-quantized") and weights.get("type") == "int"
                and weights.get("num_bits") == 8 and weights.get("symmetric", True)
                and weights.get("strategy") in ("channel", "tensor"))

    def int8_expert(self, tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One routed expert's projection of an :meth:`int8_experts` layer as (int8 ``[out, in]``, float32
        scales ``[out]``), exactly the checkpoint's values."""
        weight = self.dequantize(tensors, name) if "weight_packed" in tensors else None  # checks every tensor
        scale = tensors["weight_scale"].float().flatten()
        if weight is not None:  # pack-quantized 8-bit: the checkpoint's values, recovered exactly
            n_out = weight.shape[0]
            scale = scale.expand(n_out) if scale.numel() == 1 else scale
            return torch.round(weight / scale[:, None]).to(torch.int8), scale.contiguous()
        if "weight" not in tensors or tensors["weight"].dtype != torch.int8:
            raise CheckpointError(f"quantized expert {name!r}: its config group is int8, but the checkpoint has no "
                                  "int8 weight tensor for it")
        weight = tensors["weight"]
        if scale.numel() not in (1, weight.shape[0]):
            raise CheckpointError(f"quantized expert {name!r}: weight_scale {tuple(tensors['weight_scale'].shape)} is "
                                  f"neither one scale nor one per output row of weight {tuple(weight.shape)}")
        return weight, scale.expand(weight.shape[0]).contiguous()

    def moe_method(self, prefix: str) -> Optional[IntMoeMethod]:
        """The routed experts under ``prefix`` (the layer's MLP) kept packed and computed from the packed bits when
        their config group is pack-quantized int4 / int8 in groups (or int4 per channel), with or without
        ``actorder: group`` (not under tensor parallelism), or FP8 (kept one byte a weight, ``fp8_moe.py``); None for
        every other scheme (int8 per channel stays int8 in the MoE kernel; the rest is dequantized at load)."""
        name = f"{prefix}.experts.0.gate_proj"
        index = None if any(name_matches(name, p) for p in self.ignore) else self._group_of(name)
        if index is None or self.int8_experts(prefix):
            return None
        group_name, _, fmt, weights, _ = self.groups[index]
        if fmt in ("float-quantized", "naive-quantized") and weights.get("type") == "float":
            return fp8_moe_method(f"compressed-tensors config_groups.{group_name}", weights, self.kernel, self.host)
        strategy, bits = weights.get("strategy"), weights.get("num_bits")
        if (fmt != "pack-quantized" or weights.get("type") != "int" or bits not in (4, 8)
                or not weights.get("symmetric", True) or strategy not in ("group", "channel")):
            return None
        act_order = weights.get("actorder") == "group"
        if act_order and not packs_act_order("compressed-tensors", prefix):
            return None
        where = f"compressed-tensors config_groups.{group_name}"
        group = -1 if strategy == "channel" else check_group_size(weights.get("group_size"), where)
        return IntMoeMethod(bits, group, self.expert_ints, self.kernel, self.host, "compressed-tensors",
                            act_order=act_order)

    def expert_ints(self, tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, ...]:
        """One pack-quantized expert projection as (unsigned q ``[out, in]``, scales ``[out, groups]``, zeros: the
        stored values' offset ``2 ** (bits - 1)``, ``g_idx [in]``), in its column order."""
        group_name, _, _, weights, _ = self.groups[self._group_of(name)]
        where = f"quantized expert {name!r} (compressed-tensors config_groups.{group_name}, pack-quantized)"
        missing = [t for t in ("weight_packed", "weight_scale", "weight_shape") if t not in tensors]
        if missing:
            raise CheckpointError(f"{where} has no {', '.join(missing)} tensor(s) in the checkpoint")
        values, scale, g_idx = _unpack_expert(tensors, weights, where)
        return values, scale, torch.full_like(scale, float(1 << (int(weights["num_bits"]) - 1))), g_idx

    def dequantize(self, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """One routed expert's projection of a Mixture-of-Experts checkpoint (``name``, e.g.
        ``model.layers.0.mlp.experts.3.gate_proj``) as float32 ``[out, in]``, from its config group's tensors:
        pack-quantized ``weight_packed``/``weight_scale``/``weight_shape`` (``weight_g_idx``), int-quantized or
        FP8 ``weight``/``weight_scale``. The experts then hold the model's dtype; quantized input activations
        (W8A8) are not applied to them."""
        index = None if any(name_matches(name, p) for p in self.ignore) else self._group_of(name)
        if index is None:
            raise CheckpointError(f"quantized expert {name!r}: no compressed-tensors config group targets it (or "
                                  "it is in 'ignore'), so pagoda cannot tell how its tensors are packed")
        group_name, _, fmt, weights, _ = self.groups[index]
        where = f"quantized expert {name!r} (compressed-tensors config_groups.{group_name}, {fmt})"
        packed = fmt == "pack-quantized"
        needed = ("weight_packed", "weight_scale", "weight_shape") if packed else ("weight", "weight_scale")
        missing = [t for t in needed if t not in tensors]
        if missing:
            raise CheckpointError(f"{where} has no {', '.join(missing)} tensor(s) in the checkpoint")
        scale = tensors["weight_scale"].float()
        if packed:
            values, scale, g_idx = _unpack_expert(tensors, weights, where)
            return (values.float() - (1 << (int(weights["num_bits"]) - 1))) * scale[:, g_idx]
        weight = tensors["weight"]
        if weight.dtype == torch.int8 and not weights.get("symmetric", True):
            raise ConfigError(f"{where}: asymmetric int8 weights are not supported; expected symmetric: true")
        if weight.dtype in (torch.int8, torch.float8_e4m3fn):
            values = weight.float()
        else:
            raise CheckpointError(f"{where}: weight has dtype {weight.dtype}; expected int8 or float8_e4m3fn")
        block = weights.get("block_structure") if weights.get("strategy") == "block" else None
        if block:
            bo, bi = (int(v) for v in block)
            rows = scale.repeat_interleave(bo, 0)[: values.shape[0]]
            return values * rows.repeat_interleave(bi, 1)[:, : values.shape[1]]
        if scale.numel() not in (1, values.shape[0]):
            raise CheckpointError(f"{where}: weight_scale {tuple(scale.shape)} is neither one scale nor one per "
                                  f"output row of weight {tuple(weight.shape)}")
        return values * scale.reshape(-1, 1)

    def _group_of(self, module: str) -> Optional[int]:
        for i, (_, targets, _, _, _) in enumerate(self.groups):
            if any(t == "Linear" or name_matches(module, t) for t in targets):
                return i
        return None


def _unpack_expert(tensors: dict[str, torch.Tensor], weights: dict[str, Any],
                   where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pack-quantized expert projection's (unsigned values ``[out, in]``, float32 scales ``[out, groups]``,
    ``g_idx [in]``)."""
    bits = int(weights.get("num_bits") or 0)
    if weights.get("type") != "int" or bits not in (4, 8) or not weights.get("symmetric", True):
        raise ConfigError(f"{where}: weights {weights} are not supported; expected symmetric int, 4 or 8 bits")
    scale = tensors["weight_scale"].float()
    n_out, n_in = (int(v) for v in tensors["weight_shape"].flatten().tolist())
    values = unpack_int32(tensors["weight_packed"], bits, dim=1)[:, :n_in]
    group = n_in if weights.get("strategy") == "channel" else int(weights.get("group_size") or n_in)
    g_idx = tensors["weight_g_idx"].long() if "weight_g_idx" in tensors else torch.arange(n_in) // group
    if values.shape[0] != n_out or scale.shape[0] != n_out or int(g_idx.max()) >= scale.shape[1]:
        raise CheckpointError(f"{where}: weight_packed {tuple(tensors['weight_packed'].shape)}, weight_scale "
                              f"{tuple(scale.shape)} and weight_shape {[n_out, n_in]} do not fit together "
                              f"for {bits}-bit groups of {group}")
    return values, scale, g_idx


def _float_method(group: str, weights: dict[str, Any], acts: Optional[dict[str, Any]],
                  tables: dict) -> Fp8LinearMethod:
    where = f"compressed-tensors config_groups.{group}"
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ConfigError(f"{where}: float-quantized weights must be type float, num_bits 8; got {weights}")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise ConfigError(f"{where}: FP8 weight strategy {strategy!r} is not supported; expected tensor, channel "
                          "or block")
    block = tuple(weights.get("block_structure") or ()) if strategy == "block" else None
    activations = None
    if acts:
        if acts.get("type") != "float" or acts.get("num_bits") != 8:
            raise ConfigError(f"{where}: input activations {acts} are not supported; expected FP8 or none")
        activations = "dynamic" if acts.get("dynamic") else "static"
        if activations == "static" and acts.get("strategy") != "tensor":
            raise ConfigError(f"{where}: static activation strategy {acts.get('strategy')!r} is not supported; "
                              "expected tensor")
    return Fp8LinearMethod(strategy, activations, block, method="compressed-tensors FP8", tables=tables)


class PackedIntLinearMethod:
    """compressed-tensors "pack-quantized": symmetric int4 / int8 weights, group or channel scales."""

    def __init__(self, group: str, weights: dict[str, Any], acts: Optional[dict[str, Any]], kernel: str,
                 host: Optional[HostConfig] = None) -> None:
        where = f"compressed-tensors config_groups.{group}"
        self.bits = weights.get("num_bits")
        if weights.get("type") != "int" or self.bits not in (4, 8):
            raise ConfigError(f"{where}: pack-quantized weights of type {weights.get('type')!r} with num_bits "
                              f"{self.bits!r} are not supported; expected int with 4 or 8 bits")
        if not weights.get("symmetric", True):
            raise ConfigError(f"{where}: asymmetric pack-quantized weights are not supported; expected symmetric")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise ConfigError(f"{where}: weight strategy {strategy!r} is not supported; expected group or channel")
        self.group_size = check_group_size(weights.get("group_size"), where) if strategy == "group" else -1
        if acts:
            raise ConfigError(f"{where}: quantized input activations ({acts}) with int weights are not supported; "
                              "pagoda reads weight-only int schemes (W4A16, W8A16)")
        self.has_g_idx = weights.get("actorder") == "group"
        self.kernel, self.host = kernel, host

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        n_out, n_in = layer.out_features, layer.in_features
        if self.has_g_idx and getattr(layer, "tp_cols", None) is not None:
            raise ConfigError(f"{layer.prefix}: actorder 'group' weights are not split over input features for "
                              "tensor parallelism (each rank's columns would need every group's scales); use "
                              "tensor_parallel_size=1 or a checkpoint quantized without actorder")
        group = n_in if self.group_size == -1 else self.group_size
        layer.quant_dtype, layer.ct_group = dtype, group
        method, per_word = "compressed-tensors pack-quantized", 32 // self.bits
        add_param(layer, "weight_packed", (n_out, -(-n_in // per_word)), torch.int32,
                  output_sharded_loader(layer, method, out_dim=0, expected_dtype=torch.int32, in_pack=per_word))
        add_param(layer, "weight_scale", (n_out, -(-n_in // group)), torch.float32,
                  output_sharded_loader(layer, method, out_dim=0,
                                        in_pack=None if self.group_size == -1 else group))
        add_param(layer, "weight_shape", (len(layer.output_sizes), 2), torch.int64, per_shard_loader(layer, method))
        if self.has_g_idx:
            add_param(layer, "weight_g_idx", (len(layer.output_sizes), n_in), torch.int64,
                      per_shard_loader(layer, method, per_input=True))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        rows = shard_rows(layer)
        for i, size in enumerate(layer.full_output_sizes):  # the checkpoint's shapes, before any rank's split
            shape = layer.weight_shape.data[i].tolist()
            if shape != [size, layer.full_in_features]:
                raise CheckpointError(f"{layer.prefix}: weight_shape of shard {i} is {shape} but the model expects "
                                      f"{[size, layer.full_in_features]}")
        q = unpack_int32(layer.weight_packed.data, self.bits, dim=1)[:, : layer.in_features].contiguous()
        scales = layer.weight_scale.data  # [out, groups]
        zeros = torch.full_like(scales, float(1 << (self.bits - 1)))  # symmetric: offset of the stored values
        parts, _ = parts_from_g_idx([None] * len(rows), rows, layer.ct_group, [])
        if self.has_g_idx:
            if not loaded_suffix(layer, "weight_g_idx"):
                raise CheckpointError(f"{layer.prefix}: actorder 'group' needs weight_g_idx tensors")
            names = [f"{layer.prefix}.weight_g_idx (shard {i})" for i in range(len(rows))]
            parts, perms = parts_from_g_idx(list(layer.weight_g_idx.data), rows, layer.ct_group, names)
            for (start, end), perm in zip(rows, perms):
                if perm is not None:
                    q[start:end] = q[start:end][:, perm]
            drop_params(layer, "weight_g_idx")
        drop_params(layer, "weight_packed", "weight_scale", "weight_shape")
        install_int_weight(layer, q, scales, zeros, self.bits, layer.ct_group, parts, self.kernel, self.host)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return apply_int_linear(layer, x, bias)
