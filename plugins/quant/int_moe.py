"""Group-quantized routed experts kept packed: the experts of an MoE layer of a GPTQ, AWQ or compressed-tensors
(pack-quantized) checkpoint held in the int runtime layout of ``int_linear.py`` and computed from it.

A quant config gives each :class:`~pagoda.modeling.layers.moe.FusedMoE` whose experts it quantizes in groups an
:class:`IntMoeMethod` (its ``moe_method``), which registers the packed tensors on the layer, fills them expert by
expert from the checkpoint, and computes the routed experts:

- ``w13_q`` uint8 ``[E, 2I, bytes]``: each expert's gate rows, then its up rows, as ``packing.pack_uint8`` packs
  a row; ``w13_scales`` / ``w13_zeros`` ``[E, 2I, groups]`` in the model dtype;
- ``w2_q`` uint8 ``[E, H, bytes]`` with ``w2_scales`` / ``w2_zeros`` ``[E, H, groups]``.

``W[e, o, i] = (q - zero[e, o, i // group]) * scale[e, o, i // group]``. With the ``cpu`` int kernel, one C++
call per layer groups the tokens by expert and runs each active expert's projections through the dense int
kernel's loops (``cpu_int_kernels.cpp``: integer dot products in registers for few tokens, dequantized tiles and
a GEMM for many); elsewhere the active experts are dequantized per call and computed by the grouped torch path.
The layer's activation (``silu`` or gpt-oss's clamped SwiGLU) and expert biases, if any, are applied on both.

Act-order checkpoints (GPTQ ``desc_act``, compressed-tensors ``actorder: group``) stay packed too: each expert
projection's input columns are sorted by their ``g_idx`` at load, so that every group's columns sit together, and
the order is kept per expert (``w13_perm`` int64 ``[E, 2, H]``, the gate's and the up's; ``w2_perm`` ``[E, 1, I]``):
the kernel reads each expert's activations in its projection's order (``x[:, perm]``, ``h[:, perm]``), the torch
path puts the dequantized columns back in the checkpoint's order. Under tensor parallelism a rank's slice of the
intermediate columns would cut the down projection's scattered groups, so there act-order experts are dequantized
at load (:func:`packs_act_order`).
MXFP4 experts (``mxfp4.py``) are held the same way, their codes FP4 values with a power-of-two scale per group.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.errors import CheckpointError, ConfigError
from pagoda.execution import distributed
from pagoda.host.env import HostConfig
from pagoda.modeling.layers.moe import ACTIVATIONS, grouped_experts
from pagoda.plugins.quant.cpu_int_kernel import (IMPL_AUTO, TILE_ROWS, default_gemm_min_rows,
                                                 int_kernels_or_none)
from pagoda.plugins.quant.int_linear import parts_from_g_idx
from pagoda.plugins.quant.packing import pack_uint8, unpack_uint8

logger = logging.getLogger(__name__)

# what the kernel's codes are (its ``codes`` argument): integers, FP4 (e2m1) or FP8 (e4m3) numbers
CODES_INT, CODES_FP4, CODES_FP8 = 0, 1, 2

# (q [out, in] unsigned codes, scales [out, groups], zeros [out, groups] float32 or None, g_idx [in]: each column's
# group, or None when column i is in group i // group_size) of one expert projection, in the checkpoint's column order
ExpertInts = tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]


def packs_act_order(method: str, prefix: str) -> bool:
    """Whether act-order experts under ``prefix`` stay packed here: not under tensor parallelism (logged)."""
    tp_size = distributed.current().size
    if tp_size > 1:
        logger.info("%s: %s act-order experts are dequantized at load: a rank's slice of the intermediate columns "
                    "would cut their down projections' groups (tensor_parallel_size %d)", prefix, method, tp_size)
    return tp_size == 1


class IntMoeMethod:
    """How a layer's group-quantized experts are stored, loaded and computed (see the module docstring).

    ``unpack(tensors, name)``: one expert projection's checkpoint tensors as :data:`ExpertInts`, in the
    checkpoint's column order; ``kernel``: the quant config's int kernel (``cpu``: the C++ kernel where it builds);
    ``act_order``: the config says the columns were quantized in act-order (a ``g_idx`` then orders them).
    """

    # how the codes give weights: (q - zero) * scale, with scales and zero points in the model dtype
    has_zeros = True
    codes = CODES_INT

    def __init__(self, bits: int, group_size: int, unpack: Callable[[dict[str, torch.Tensor], str], ExpertInts],
                 kernel: str, host: Optional[HostConfig], method: str, act_order: bool = False) -> None:
        self.bits, self.group_size, self.unpack, self.kernel, self.host = bits, group_size, unpack, kernel, host
        self.method, self.act_order = method, act_order

    # ---- weights ----------------------------------------------------------------------------------------

    def scale_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the scales are held in for a model in ``dtype``."""
        return dtype

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """Register the packed tensors on ``layer`` (a FusedMoE), sized for this rank's slice of the experts."""
        num_experts, hidden, inter = layer.num_experts, layer.hidden_size, layer.intermediate_size
        if self.group_size != -1 and layer.tp.size > 1 and (layer.inter_start % self.group_size
                                                            or inter % self.group_size):
            raise ConfigError(f"{layer.prefix}: this rank's {inter} intermediate columns from {layer.inter_start} "
                              f"split the experts' groups of {self.group_size}; use another tensor_parallel_size")
        for name, rows, cols in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
            group = self.group_of(cols)
            groups = -(-cols // group)
            width = groups * group if self.bits == 8 else (groups * group + 1) // 2
            layer.register_parameter(f"{name}_q", _frozen(torch.zeros(num_experts, rows, width, dtype=torch.uint8)))
            layer.register_parameter(f"{name}_scales", _frozen(torch.zeros(num_experts, rows, groups,
                                                                           dtype=self.scale_dtype(dtype))))
            if self.has_zeros:
                layer.register_parameter(f"{name}_zeros", _frozen(torch.zeros(num_experts, rows, groups, dtype=dtype)))
        if self.act_order:
            if layer.tp.size > 1:
                raise ConfigError(f"{layer.prefix}: act-order experts cannot stay packed over tensor-parallel ranks "
                                  "(a rank's intermediate columns cut the down projections' groups); the quant config "
                                  "has them dequantized at load there")
            for name, parts, cols in (("w13", 2, hidden), ("w2", 1, inter)):  # identity until an expert loads
                order = torch.arange(cols).expand(num_experts, parts, cols).contiguous()
                layer.register_parameter(f"{name}_perm", _frozen(order))
        layer.int_kernels = int_kernels_or_none(self.host) if self.kernel == "cpu" else None

    def group_of(self, in_features: int) -> int:
        """The group size of a projection with ``in_features`` inputs on this rank (-1: one group per row)."""
        return in_features if self.group_size == -1 else self.group_size

    def kinds(self) -> tuple[str, ...]:
        """The tensors held per projection: codes, scales and (for integer codes) zero points."""
        return ("q", "scales", "zeros") if self.has_zeros else ("q", "scales")

    def load_expert(self, layer: nn.Module, part: str, expert: int, tensors: dict[str, torch.Tensor],
                    name: str) -> None:
        """Expert ``expert``'s ``gate``/``up``/``down`` projection from its checkpoint tensors (full size)."""
        q, scales, zeros, g_idx = self.unpack(tensors, name)
        full, hidden, inter, start = (layer.full_intermediate_size, layer.hidden_size, layer.intermediate_size,
                                      layer.inter_start)
        expected = (hidden, full) if part == "down" else (full, hidden)
        if tuple(q.shape) != expected:
            raise CheckpointError(f"quantized expert {name!r} is {tuple(q.shape)} but the model expects {expected} "
                                  f"for {layer.prefix}; the checkpoint does not match its config.json")
        per_group = [scales] if zeros is None else [scales, zeros]
        if part == "down":
            q = q.narrow(1, start, inter)
            if self.group_size != -1:
                per_group = [t.narrow(1, start // self.group_size, -(-inter // self.group_size)) for t in per_group]
            prefix, row = "w2", 0
        else:
            q, per_group = q.narrow(0, start, inter), [t.narrow(0, start, inter) for t in per_group]
            prefix, row = "w13", 0 if part == "gate" else inter
        rows, groups = (hidden if part == "down" else inter), getattr(layer, f"{prefix}_scales").shape[2]
        if len(per_group) != len(self.kinds()) - 1 or any(tuple(t.shape) != (rows, groups) for t in per_group):
            raise CheckpointError(f"quantized expert {name!r}: {tuple(per_group[0].shape)} scales for {rows} rows in "
                                  f"{groups} groups; its {self.method} tensors do not fit its shape")
        group = self.group_of(q.shape[1])
        if g_idx is not None:
            q = self._in_group_order(layer, q, g_idx, group, prefix, expert, part, name)
        q = F.pad(q, (0, groups * group - q.shape[1]))
        for kind, value in zip(self.kinds(), [pack_uint8(q, self.bits)] + per_group):
            getattr(layer, f"{prefix}_{kind}").data[expert].narrow(0, row, rows).copy_(value)

    def _in_group_order(self, layer: nn.Module, q: torch.Tensor, g_idx: torch.Tensor, group: int, prefix: str,
                        expert: int, part: str, name: str) -> torch.Tensor:
        """``q [rows, in]`` with its columns sorted by ``g_idx``, the order kept in the layer's ``*_perm``."""
        _, (perm,) = parts_from_g_idx([g_idx], [(0, q.shape[0])], group, [f"{name}.g_idx"])
        if perm is None:
            return q
        if not self.act_order:
            raise CheckpointError(f"quantized expert {name!r}: its g_idx reorders the input columns, but the "
                                  f"{self.method} config does not say act-order; fix the config (GPTQ: desc_act: "
                                  "true, compressed-tensors: actorder: group)")
        getattr(layer, f"{prefix}_perm").data[expert, 1 if part == "up" else 0].copy_(perm)
        return q[:, perm]

    def expert_bytes(self, layer: nn.Module) -> int:
        """Bytes of one expert's packed weights, scales, zero points and column orders on this rank."""
        kinds = self.kinds() + (("perm",) if self.act_order else ())
        return sum(getattr(layer, f"{name}_{kind}")[0].nbytes for name in ("w13", "w2") for kind in kinds)

    # ---- compute ----------------------------------------------------------------------------------------

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``weights``/``ids [T, k]`` -> this rank's ``[T, H]`` in ``x``'s dtype."""
        kernels = layer.int_kernels
        # E8M0 bytes and FP8's float32 scales fit any dtype
        scales_fit = self.codes != CODES_INT or x.dtype == layer.w13_scales.dtype
        p13, p2 = getattr(layer, "w13_perm", None), getattr(layer, "w2_perm", None)
        if kernels is not None and x.device.type == "cpu" and scales_fit:
            return kernels.int_moe_experts(x.contiguous(), layer.w13_q, layer.w13_scales,
                                           getattr(layer, "w13_zeros", None), layer.w2_q, layer.w2_scales,
                                           getattr(layer, "w2_zeros", None), layer.b13, layer.b2, p13, p2,
                                           ids.contiguous(), weights.float().contiguous(), self.bits, self.codes,
                                           self.group_of(layer.hidden_size), self.group_of(layer.intermediate_size),
                                           ACTIVATIONS[layer.activation], layer.alpha, layer.limit,
                                           IMPL_AUTO, default_gemm_min_rows(kernels), TILE_ROWS)
        active = torch.unique(ids)  # only the experts some token chose are dequantized
        index = torch.full((layer.num_experts,), -1, dtype=torch.long, device=ids.device)
        index[active] = torch.arange(active.numel(), device=ids.device)
        w13 = self.dequantize(layer, "w13", active, layer.hidden_size, x.dtype)
        w2 = self.dequantize(layer, "w2", active, layer.intermediate_size, x.dtype)
        if p13 is not None:  # act-order: the packed column j is the checkpoint's column perm[j]
            w13 = w13.scatter(2, p13[active].repeat_interleave(layer.intermediate_size, dim=1), w13)
            w2 = w2.scatter(2, p2[active].expand(-1, layer.hidden_size, -1), w2)
        b13, b2 = (None, None) if layer.b13 is None else (layer.b13[active], layer.b2[active])
        return grouped_experts(x, w13, w2, weights, index[ids], layer.activation, b13, b2, layer.alpha, layer.limit)

    def dequantize(self, layer: nn.Module, name: str, experts: torch.Tensor, in_features: int,
                   dtype: torch.dtype) -> torch.Tensor:
        """``experts``' ``w13`` or ``w2`` as ``[n, rows, in_features]`` in ``dtype`` (the model's)."""
        q = getattr(layer, f"{name}_q")[experts]  # [n, rows, bytes]
        scales, zeros = getattr(layer, f"{name}_scales")[experts], getattr(layer, f"{name}_zeros")[experts]
        n, rows, groups = scales.shape
        w = unpack_uint8(q.reshape(n * rows, -1), self.bits, scales.dtype)
        w = w[:, : groups * self.group_of(in_features)].view(n, rows, groups, -1)
        w = (w - zeros.unsqueeze(-1)) * scales.unsqueeze(-1)
        return w.view(n, rows, -1)[:, :, :in_features].to(dtype)

    def isa_path(self, layer: nn.Module) -> str:
        """The path the experts take here, for benchmarks and logs."""
        if layer.int_kernels is None:
            return f"{self.describe()} experts, dequantized per call (torch)"
        return f"{self.describe()} packed experts, {layer.int_kernels.isa_path()} int kernel"

    def describe(self) -> str:
        return f"{self.bits}-bit"


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)
