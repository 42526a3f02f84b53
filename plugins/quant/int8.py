"""int8 weights with one scale per output channel; W8A8 multiplies them by int8 activations with integer sums.

Two sources:
- online (``--quantization int8`` on a dense checkpoint): each checkpoint tensor is quantized while it
  loads, symmetric per output row (``s = max|w| / 127``, ``q = round(w / s)`` in [-127, 127]), so the
  full-precision weight is never held;
- compressed-tensors "int-quantized" (llm-compressor's W8A8 and W8A16 int8): ``weight`` int8
  ``[out, in]``, ``weight_scale`` ``[out, 1]`` (channel) or one scalar per module (tensor), and an
  optional ``weight_zero_point`` that must be zero (symmetric). ``W = weight * scale``.

W8A8 activations are quantized symmetrically per token at run time (``cpu_int8_kernel.py``) and the
sums are exact int32; int-quantized W8A16 (no ``input_activations``) runs through the group-wise int
kernel of ``int_linear.py`` as 8-bit weights with one group per row.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.errors import CheckpointError, ConfigError
from pagoda.host.env import HostConfig, host_config_of
from pagoda.plugins.quant.base import (
    add_param, check_tensor, drop_params, is_skipped, kernel_for_device, loaded_suffix, mark_loaded, name_matches,
    output_sharded_loader, per_shard_loader, shard_rows, tp_part)
from pagoda.plugins.quant.cpu_int8_kernel import (
    BLOCK_ROWS, cpu_int8_linear, int8_kernels_or_none, int8_linear_reference, pack_int8_weight, unpack_int8_weight)
from pagoda.plugins.quant.int_linear import IntPart, apply_int_linear, install_int_weight

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [rows, in]`` -> (int8 ``q``, float32 ``scale [rows]``), symmetric per row."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [rows]
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8LinearMethod:
    """``source``: online | channel | tensor (the checkpoint's scale strategy); ``activations``: int8 | None."""

    def __init__(self, source: str, kernel: str, activations: Optional[str] = "int8",
                 method: str = "int8", host: Optional[HostConfig] = None) -> None:
        """``host``: the engine's settings, which the C++ kernel is built for (None: the environment's)."""
        self.source, self.kernel, self.activations, self.method = source, kernel, activations, method
        self.host = host
        # W8A8 through the C++ kernel: loaded now, at start-up (None where it cannot be built)
        self.cpu_kernels = int8_kernels_or_none(host) if kernel == "cpu" and activations is not None else None

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        n_out, n_in = layer.out_features, layer.in_features
        layer.quant_dtype = dtype
        if self.source == "online":
            add_param(layer, "weight", (n_out, n_in), torch.int8, self._online_loader(layer))
            layer.register_buffer("weight_scale_rows", torch.ones(n_out), persistent=False)
            return
        add_param(layer, "weight", (n_out, n_in), torch.int8,
                  output_sharded_loader(layer, self.method, out_dim=0, expected_dtype=torch.int8, in_pack=1))
        if self.source == "channel":
            add_param(layer, "weight_scale", (n_out, 1), torch.float32, output_sharded_loader(layer, self.method, 0))
            zero = add_param(layer, "weight_zero_point", (n_out, 1), torch.int32,
                             output_sharded_loader(layer, self.method, 0))
        else:
            num_shards = len(layer.output_sizes)
            add_param(layer, "weight_scale", (num_shards,), torch.float32,
                      per_shard_loader(layer, self.method, squeeze_scalar=True))
            zero = add_param(layer, "weight_zero_point", (num_shards,), torch.int32,
                             per_shard_loader(layer, self.method, squeeze_scalar=True))
        zero.is_optional = True  # symmetric schemes: older compressed-tensors wrote zeros, newer write none

    def _online_loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int], name: str) -> None:
            if not loaded.is_floating_point():
                raise CheckpointError(f"tensor {name!r} is {loaded.dtype}; --quantization int8 quantizes dense "
                                      "float checkpoints (a quantized checkpoint loads without --quantization)")
            # this rank's rows; each row's scale from the whole row, as on one rank, then its columns
            loaded = tp_part(layer, loaded, shard_id, 0, 1, None, "online int8")
            q, scale = quantize_rows(loaded)
            if getattr(layer, "tp_cols", None) is not None:
                q = q.narrow(1, *layer.tp_cols)
            start, size = layer.shard_offset(shard_id) if shard_id is not None else (0, layer.out_features)
            check_tensor(q, (size, layer.in_features), None, name, "online int8", layer)
            param.data[start:start + size], layer.weight_scale_rows[start:start + size] = q, scale
            mark_loaded(layer, name)

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.source == "online":
            scale = layer.weight_scale_rows
        else:
            if loaded_suffix(layer, "weight_zero_point") and layer.weight_zero_point.data.any():
                raise CheckpointError(f"{layer.prefix}: weight_zero_point is not zero; pagoda reads symmetric int8 "
                                      "weights only (quantize with symmetric: true)")
            raw = layer.weight_scale.data
            if self.source == "tensor":  # one scalar per fused shard -> one per output row
                scale = torch.cat([raw[i].expand(end - start) for i, (start, end) in enumerate(shard_rows(layer))])
            else:
                scale = raw.squeeze(1)
            drop_params(layer, "weight_scale", "weight_zero_point")
        q = layer.weight.data
        drop_params(layer, "weight")
        if "weight_scale_rows" in layer._buffers:
            del layer._buffers["weight_scale_rows"]
        if self.activations is None:  # W8A16: the group-wise int runtime, q + 128 against a zero point of 128
            zeros = torch.full((q.shape[0], 1), 128.0)
            install_int_weight(layer, (q.to(torch.int16) + 128).to(torch.uint8), scale[:, None], zeros, 8,
                               layer.in_features, [IntPart(0, layer.out_features, None)], self.kernel, self.host)
            return
        packed, colsum = pack_int8_weight(q)
        layer.register_buffer("w8_packed", packed, persistent=False)  # int8 [N_pad / 16, K_pad * 16]
        layer.register_buffer("w8_colsum", colsum, persistent=False)  # int32 [N_pad]
        n_pad = packed.shape[0] * BLOCK_ROWS
        layer.register_buffer("w8_scale", F.pad(scale.float(), (0, n_pad - scale.numel())).contiguous(),
                              persistent=False)  # float32 [N_pad]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.activations is None:
            return apply_int_linear(layer, x, bias)
        if self.kernel == "cpu" and x.device.type == "cpu" and x.dtype in KERNEL_DTYPES:
            kernels = self.cpu_kernels
            if kernels is not None:
                return cpu_int8_linear(kernels, x, layer.w8_packed, layer.w8_colsum, layer.w8_scale,
                                       layer.out_features, None if bias is None else bias.float())
        q = unpack_int8_weight(layer.w8_packed, layer.out_features, layer.in_features)
        return int8_linear_reference(x, q, layer.w8_scale[: layer.out_features], bias)


class Int8Config:
    """``--quantization int8``: online W8A8 of a dense checkpoint's linear layers."""

    def __init__(self, model_config: Any, cfg: dict[str, Any]) -> None:
        existing = cfg.get("quant_method")
        if existing not in (None, "int8"):
            raise ConfigError(f"--quantization int8 quantizes a dense checkpoint while it loads, but this one is "
                              f"already quantized ({existing}); drop --quantization to run its own scheme")
        self.ignored = list(cfg.get("ignored_layers") or [])
        # the engine's host settings: its quant_kernel, and the ISA level its C++ kernel is built for
        self.host = host_config_of(model_config)
        self.kernel = kernel_for_device(self.host.quant_kernel)

    def for_layer(self, prefix: str) -> Optional[Int8LinearMethod]:
        if is_skipped(prefix, lambda m: any(name_matches(m, p) for p in self.ignored), "int8"):
            return None
        return Int8LinearMethod("online", self.kernel, method="online int8", host=self.host)


def compressed_tensors_int8(group: str, weights: dict[str, Any], acts: Optional[dict[str, Any]],
                            kernel: str, host: Optional[HostConfig] = None) -> Int8LinearMethod:
    """The method for a compressed-tensors "int-quantized" config group (W8A8 or W8A16 int8)."""
    where = f"compressed-tensors config_groups.{group}"
    if weights.get("type") != "int" or weights.get("num_bits") != 8:
        raise ConfigError(f"{where}: int-quantized weights must be type int with num_bits 8; got "
                          f"type {weights.get('type')!r}, num_bits {weights.get('num_bits')!r}")
    if not weights.get("symmetric", True):
        raise ConfigError(f"{where}: asymmetric int8 weights are not supported; expected symmetric: true")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor"):
        raise ConfigError(f"{where}: int8 weight strategy {strategy!r} is not supported; expected channel or tensor")
    if not acts:
        return Int8LinearMethod(strategy, kernel, activations=None, method="compressed-tensors int8", host=host)
    wanted = {"type": "int", "num_bits": 8, "dynamic": True, "strategy": "token", "symmetric": True}
    wrong = {k: acts.get(k) for k, v in wanted.items() if acts.get(k, True if k == "symmetric" else None) != v}
    if wrong:
        raise ConfigError(f"{where}: input activations {wrong} are not supported; pagoda's W8A8 quantizes "
                          f"activations as {wanted} (dynamic, symmetric, one scale per token)")
    return Int8LinearMethod(strategy, kernel, method="compressed-tensors int8", host=host)


def uses_int8_kernel(model: nn.Module) -> bool:
    """True when some linear layer of ``model`` multiplies through the W8A8 kernel."""
    return any(hasattr(m, "w8_packed") for m in model.modules())
