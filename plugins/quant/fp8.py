"""FP8 (float8_e4m3fn) weights: checkpoints written with scales, and online quantization of dense ones.

Serialized layouts (``out``/``in`` features):
- ``weight`` fp8 ``[out, in]`` with ``weight_scale`` per tensor (one scalar per
  checkpoint module, vLLM's ``quant_method: fp8`` and compressed-tensors'
  "tensor" strategy), per channel ``[out, 1]`` (compressed-tensors "channel"),
  or per block ``[ceil(out / bo), ceil(in / bi)]`` (``weight_scale_inv`` in
  ``quant_method: fp8`` with ``weight_block_size``).
- ``input_scale`` (one scalar per module) when activations are quantized
  statically; "dynamic" activations take a scale per token at run time.
``W = weight * scale``. Activation quantization is emulated (quantize to fp8
and back) so results follow what the checkpoint prescribes.

Online (``--quantization fp8`` on a dense checkpoint): each checkpoint tensor
is quantized to fp8 with one scale per output channel while it loads, so the
full-precision weight is never held.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.errors import ConfigError
from pagoda.host.env import host_config_of
from pagoda.plugins.quant.base import (
    add_param, check_tensor, drop_params, is_skipped, kernel_for_device, mark_loaded, name_matches,
    output_sharded_loader, per_shard_loader, shard_rows, tp_part)
from pagoda.plugins.quant.fp8_moe import Fp8MoeMethod

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` rounded to float8_e4m3fn (saturating at +-448)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """The 256 float8_e4m3fn values in ``dtype`` (exact for float32 / bf16 / fp16), indexed by their bits."""
    return torch.arange(256, dtype=torch.uint8).view(FP8).to(dtype)


def fp8_values(weight: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """fp8 ``weight`` -> ``table.dtype`` by a table lookup: several times faster than ``.to()`` on a CPU."""
    codes = weight.view(torch.uint8).reshape(-1).to(torch.int32)
    return table.index_select(0, codes).view(weight.shape)


def fake_quantize_activations(x: torch.Tensor, input_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Round activations through fp8: static ``input_scale`` (scalar), or dynamic per token when None."""
    if input_scale is None:
        input_scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # [..., 1]
    return (quantize_fp8(x, input_scale).float() * input_scale).to(x.dtype)


class Fp8LinearMethod:
    """``strategy``: tensor | channel | block | online; ``activations``: None | dynamic | static."""

    def __init__(self, strategy: str, activations: Optional[str], block: Optional[tuple[int, int]] = None,
                 scale_name: str = "weight_scale", method: str = "FP8",
                 tables: Optional[dict[torch.dtype, torch.Tensor]] = None) -> None:
        self.strategy, self.activations, self.block = strategy, activations, block
        self.scale_name, self.method = scale_name, method
        self.tables = {} if tables is None else tables  # one lookup table per dtype, shared by every layer

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        n_out, n_in = layer.out_features, layer.in_features
        layer.quant_dtype = dtype
        # a float32 model multiplies weights by their scales exactly before the matmul (as the reference
        # tools dequantize); bf16/fp16 models scale the [tokens, out] result instead, which is much cheaper
        # (block scales always go on the weight)
        self.scale_output = dtype != torch.float32 and self.strategy != "block"
        table_dtype = dtype if self.scale_output else torch.float32
        if table_dtype not in self.tables:
            self.tables[table_dtype] = fp8_table(table_dtype)
        layer.register_buffer("fp8_table", self.tables[table_dtype], persistent=False)
        if self.strategy == "online":
            add_param(layer, "weight", (n_out, n_in), FP8, self._online_loader(layer))
            layer.register_buffer("weight_scale_rows", torch.ones(n_out), persistent=False)
            return
        add_param(layer, "weight", (n_out, n_in), FP8,
                  output_sharded_loader(layer, self.method, out_dim=0, expected_dtype=FP8, in_pack=1))
        num_shards = len(layer.output_sizes)
        if self.strategy == "tensor":
            add_param(layer, self.scale_name, (num_shards,), torch.float32,
                      per_shard_loader(layer, self.method, squeeze_scalar=True))
        elif self.strategy == "channel":
            add_param(layer, self.scale_name, (n_out, 1), torch.float32,
                      output_sharded_loader(layer, self.method, out_dim=0))
        else:
            bo, bi = self.block
            if n_in % bi or any(size % bo for size in layer.output_sizes):
                raise ConfigError(f"{layer.prefix}: block-wise FP8 with blocks {list(self.block)} needs in_features "
                                  f"({n_in}) and every output shard {layer.output_sizes} divisible by them")
            add_param(layer, self.scale_name, (n_out // bo, n_in // bi), torch.float32,
                      output_sharded_loader(layer, self.method, out_dim=0, pack=bo, in_pack=bi))
        if self.activations == "static":
            add_param(layer, "input_scale", (num_shards,), torch.float32,
                      per_shard_loader(layer, self.method, squeeze_scalar=True), fill=1.0)

    def _online_loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int], name: str) -> None:
            # this rank's rows of the dense weight; each row's scale from the whole row, as on one rank
            loaded = tp_part(layer, loaded, shard_id, 0, 1, None, "online FP8")
            scale = loaded.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # [size, 1]
            if getattr(layer, "tp_cols", None) is not None:
                loaded = loaded.narrow(1, *layer.tp_cols)
            start, size = layer.shard_offset(shard_id) if shard_id is not None else (0, layer.out_features)
            check_tensor(loaded, (size, layer.in_features), None, name, "online FP8", layer)
            param.data[start:start + size] = quantize_fp8(loaded, scale)
            layer.weight_scale_rows[start:start + size] = scale.squeeze(1)
            mark_loaded(layer, name)

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.strategy in ("tensor", "channel"):
            scale = getattr(layer, self.scale_name).data
            if self.strategy == "tensor":  # one scalar per fused shard -> one per output row
                rows = torch.cat([scale[i].expand(end - start) for i, (start, end) in enumerate(shard_rows(layer))])
            else:
                rows = scale.squeeze(1)
            drop_params(layer, self.scale_name)
            layer.register_buffer("weight_scale_rows", rows.contiguous(), persistent=False)
        if self.activations == "static":
            # fused modules read the same input, so their calibrated scales agree; take the largest as vLLM does
            layer.register_buffer("input_scale_max", layer.input_scale.data.max().reshape(()), persistent=False)
            drop_params(layer, "input_scale")

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """Full-precision ``[out, in]`` weight (built per call, never kept)."""
        dtype = layer.quant_dtype
        if self.strategy == "block":
            bo, bi = self.block
            scale = getattr(layer, self.scale_name)  # [out / bo, in / bi]
            w = fp8_values(layer.weight, layer.fp8_table).view(scale.shape[0], bo, scale.shape[1], bi)
            w = w * scale[:, None, :, None]
            return w.view(layer.out_features, layer.in_features).to(dtype)
        # products in float32 (exact for fp8 x fp16/bf16 scales), then one rounding to the model dtype
        return (fp8_values(layer.weight, layer.fp8_table) * layer.weight_scale_rows[:, None]).to(dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.activations is not None:
            x = fake_quantize_activations(x, layer.input_scale_max if self.activations == "static" else None)
        if not self.scale_output:
            return F.linear(x, self.dequantize(layer), bias)
        # the per-channel scale commutes with the matmul
        y = F.linear(x, fp8_values(layer.weight, layer.fp8_table)) * layer.weight_scale_rows.to(x.dtype)
        return y if bias is None else y + bias


class Fp8Config:
    """``quant_method: fp8`` checkpoints (vLLM's format), or online FP8 of a dense checkpoint."""

    def __init__(self, model_config: Any, cfg: dict[str, Any]) -> None:
        self.serialized = cfg.get("quant_method") == "fp8"
        self.activations = cfg.get("activation_scheme", "dynamic") if self.serialized else None
        if self.activations not in (None, "dynamic", "static"):
            raise ConfigError(f"FP8 activation_scheme {self.activations!r} is not supported; expected dynamic or "
                              "static")
        block = cfg.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ConfigError(f"FP8 weight_block_size {block!r} is not supported; expected two positive ints")
        self.block = tuple(block) if block else None
        if cfg.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"FP8 format {cfg.get('fmt')!r} is not supported; pagoda reads float8_e4m3fn weights")
        self.ignored = list(cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or [])
        self.tables: dict[torch.dtype, torch.Tensor] = {}
        # the engine's host settings: its quant_kernel, and the ISA level the MoE experts' C++ kernel is built for
        self.host = host_config_of(model_config)
        self.kernel = kernel_for_device(self.host.quant_kernel)

    def moe_method(self, prefix: str) -> Optional[Fp8MoeMethod]:
        """The routed experts under ``prefix`` (the layer's MLP) kept one byte a weight (``fp8_moe.py``), their scales
        per block of ``weight_block_size`` (``weight_scale_inv``) or one per module (``weight_scale``); None when the
        config leaves them unquantized. Online FP8 of a dense checkpoint is not applied to experts."""
        if not self.serialized:
            raise ConfigError("online FP8 (--quantization fp8) quantizes linear layers, not a Mixture-of-Experts "
                              "model's experts; load the model unquantized, or an FP8 checkpoint of it")
        if any(name_matches(f"{prefix}.experts.0.gate_proj", p) for p in self.ignored):
            return None
        if self.block is None:
            return Fp8MoeMethod(-1, 1, self.kernel, self.host, "FP8")
        rows, cols = self.block
        return Fp8MoeMethod(cols, rows, self.kernel, self.host, "FP8", scale_name="weight_scale_inv")

    def for_layer(self, prefix: str) -> Optional[Fp8LinearMethod]:
        if is_skipped(prefix, lambda m: any(name_matches(m, p) for p in self.ignored), "FP8"):
            return None
        if not self.serialized:
            return Fp8LinearMethod("online", None, tables=self.tables)
        if self.block is not None:
            return Fp8LinearMethod("block", self.activations, self.block, scale_name="weight_scale_inv",
                                   tables=self.tables)
        return Fp8LinearMethod("tensor", self.activations, tables=self.tables)
