"""The runtime of every group-wise integer method (AWQ, GPTQ, compressed-tensors pack-quantized).

Each method converts its checkpoint layout once, after loading, into the same
packed form on the layer (no full-precision copy is kept):

- ``w_q``      uint8 ``[out, in_pad * bits / 8]``  (see ``packing.pack_uint8``)
- ``w_scales`` ``[out, groups]`` in the model dtype
- ``w_zeros``  ``[out, groups]`` in the model dtype (zero points as numbers)

where ``in_pad = groups * group_size >= in`` (the last group of a layer whose
width is not a multiple of the group size is padded with zero weights).
``W[o, i] = (q[o, i] - w_zeros[o, i // gs]) * w_scales[o, i // gs]``, then
``y = x[:, perm] @ W^T`` when the checkpoint reordered its input columns
(GPTQ act-order). A fused layer whose shards were reordered differently keeps
one (rows, perm) part per shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.errors import CheckpointError
from pagoda.host.env import HostConfig
from pagoda.plugins.quant.cpu_int_kernel import cpu_int_linear, int_kernels_or_none
from pagoda.plugins.quant.packing import pack_uint8, unpack_awq, unpack_int32, unpack_uint8


@dataclass(frozen=True)
class IntPart:
    """Rows ``[row_start, row_end)`` of a layer that share one input permutation (or none)."""

    row_start: int
    row_end: int
    perm: Optional[torch.Tensor]  # [in] int64, or None for the identity


def install_int_weight(layer: nn.Module, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       bits: int, group_size: int, parts: list[IntPart], kernel: str,
                       host: Optional[HostConfig] = None) -> None:
    """Store ``q [out, in]`` (unsigned ints), ``scales``/``zeros [out, groups]`` in the runtime layout; with
    ``kernel`` cpu, load the C++ kernel as the engine's ``host`` settings build it (None: the environment's)."""
    out_features, in_features = q.shape
    num_groups = scales.shape[1]
    in_pad = num_groups * group_size
    if in_pad != in_features:
        q = F.pad(q, (0, in_pad - in_features))
    dtype = layer.quant_dtype
    layer.w_q = nn.Parameter(pack_uint8(q, bits), requires_grad=False)
    layer.w_scales = nn.Parameter(scales.to(dtype).contiguous(), requires_grad=False)
    layer.w_zeros = nn.Parameter(zeros.to(dtype).contiguous(), requires_grad=False)
    layer.int_bits, layer.int_group_size, layer.int_kernel = bits, group_size, kernel
    layer.int_cpu_kernels = int_kernels_or_none(host) if kernel == "cpu" else None
    for i, part in enumerate(parts):
        if part.perm is not None:
            layer.register_buffer(f"w_perm_{i}", part.perm.to(torch.int64), persistent=False)
    layer.int_parts = [(p.row_start, p.row_end, p.perm is not None) for p in parts]


def dequantize_int_rows(layer: nn.Module, row_start: int, row_end: int) -> torch.Tensor:
    """Full-precision ``[rows, in]`` weight of rows ``[row_start, row_end)``; built per call, never kept."""
    scales = layer.w_scales[row_start:row_end]  # [rows, groups]
    zeros = layer.w_zeros[row_start:row_end]
    rows, num_groups = scales.shape
    w = unpack_uint8(layer.w_q[row_start:row_end], layer.int_bits, scales.dtype)  # [rows, in_pad]
    w = w[:, : num_groups * layer.int_group_size].view(rows, num_groups, -1)
    w.sub_(zeros.unsqueeze(-1)).mul_(scales.unsqueeze(-1))  # [rows, groups, group_size], in place: one buffer
    return w.view(rows, -1)[:, : layer.in_features]


def apply_int_linear(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x [..., in] -> [..., out]`` through the packed weight of ``layer``.

    ``layer.int_kernel`` picks how: ``cpu`` (the C++ kernel of ``cpu_int_kernel.py``; the torch path
    when it cannot be compiled or the input is not a CPU tensor of the model dtype), ``triton``, or
    ``torch`` (dequantize each part, then ``F.linear``: the reference).
    """
    if layer.int_kernel == "cpu" and x.device.type == "cpu" and x.dtype == layer.w_scales.dtype:
        kernels = layer.int_cpu_kernels
        if kernels is not None:
            return cpu_int_linear(kernels, layer, x, bias)
    outputs = []
    for i, (row_start, row_end, has_perm) in enumerate(layer.int_parts):
        xin = x.index_select(-1, getattr(layer, f"w_perm_{i}")) if has_perm else x
        if layer.int_kernel == "triton":
            from pagoda.plugins.quant.triton_kernels import int_dequant_matmul

            outputs.append(int_dequant_matmul(xin, layer, row_start, row_end))
        else:
            outputs.append(F.linear(xin, dequantize_int_rows(layer, row_start, row_end)))
    y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
    return y if bias is None else y + bias


def parts_from_g_idx(g_idx_per_shard: list[Optional[torch.Tensor]], shard_rows: list[tuple[int, int]],
                     group_size: int, names: list[str]) -> tuple[list[IntPart], list[Optional[torch.Tensor]]]:
    """Turn each shard's ``g_idx [in]`` (group of every input column) into input permutations.

    Returns the parts (shards with equal permutations merged) and, per shard,
    the permutation to apply to that shard's weight columns (or None). After
    sorting, columns of group ``g`` sit at ``g * group_size`` onward, which
    is what act-order checkpoints guarantee (every group holds ``group_size``
    columns except possibly the last); ``names`` name each shard's g_idx
    tensor for the error raised when it does not.
    """
    perms: list[Optional[torch.Tensor]] = []
    for g_idx in g_idx_per_shard:
        if g_idx is None:
            perms.append(None)
            continue
        perm = torch.argsort(g_idx.to(torch.int64), stable=True)
        expected = torch.arange(perm.numel()) // group_size
        if not torch.equal(g_idx.to(torch.int64)[perm], expected):
            raise CheckpointError(
                f"tensor {names[len(perms)]!r} does not assign {group_size} input columns to each group "
                f"(group_size {group_size}); the checkpoint's g_idx does not match its quantization config")
        trivial = torch.equal(perm, torch.arange(perm.numel()))
        perms.append(None if trivial else perm)
    parts: list[IntPart] = []
    for (start, end), perm in zip(shard_rows, perms):
        last = parts[-1] if parts else None
        same = last is not None and (
            (last.perm is None and perm is None)
            or (last.perm is not None and perm is not None and torch.equal(last.perm, perm)))
        if same:
            parts[-1] = IntPart(last.row_start, end, last.perm)
        else:
            parts.append(IntPart(start, end, perm))
    return parts, perms


def unpack_expert(quant: Any, tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, ...]:
    """One expert projection of a GPTQ or AWQ checkpoint (``qweight``, ``qzeros``, ``scales``, GPTQ's optional
    ``g_idx``) as (q ``[out, in]``, scales float32 ``[out, G]``, zeros ``[out, G]``, ``g_idx [in]``): ``W[o, i] =
    (q[o, i] - zeros[o, g_idx[i]]) * scales[o, g_idx[i]]``."""
    missing = [t for t in ("qweight", "qzeros", "scales") if t not in tensors]
    if missing:
        raise CheckpointError(f"quantized expert {name!r} has no {', '.join(missing)} tensor(s) in the checkpoint")
    gptq = type(quant).__name__ == "GPTQConfig"
    if gptq:
        q = unpack_int32(tensors["qweight"], quant.bits, dim=0)  # [in, out]
        zeros = unpack_int32(tensors["qzeros"], quant.bits, dim=1) + quant.zero_offset  # [G, out]
    else:
        q, zeros = unpack_awq(tensors["qweight"]), unpack_awq(tensors["qzeros"])
    n_in, scales = q.shape[0], tensors["scales"].float()
    group = n_in if quant.group_size == -1 else quant.group_size
    if gptq and "g_idx" in tensors:
        g_idx = tensors["g_idx"].long()
    elif gptq and quant.desc_act:
        raise CheckpointError(f"{name}: the config sets desc_act but the checkpoint has no g_idx tensor")
    else:
        g_idx = torch.arange(n_in) // group
    if scales.shape[0] != zeros.shape[0] or scales.shape[1] != q.shape[1] or int(g_idx.max()) >= scales.shape[0]:
        raise CheckpointError(f"quantized expert {name!r}: qweight {tuple(tensors['qweight'].shape)}, qzeros "
                              f"{tuple(tensors['qzeros'].shape)} and scales {tuple(scales.shape)} do not fit together "
                              f"for {quant.bits}-bit groups of {group}")
    return q.t(), scales.t(), zeros.t().float(), g_idx


def dequantize_expert(quant: Any, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """One expert projection of a GPTQ or AWQ checkpoint as float32 ``[out, in]`` (see :func:`unpack_expert`)."""
    q, scales, zeros, g_idx = unpack_expert(quant, tensors, name)
    return ((q.float() - zeros[:, g_idx]) * scales[:, g_idx]).contiguous()
