"""Triton PagedAttention decode: one query token per request, K/V read through the block table.

One program per (request, KV head, split). The program loads the GROUP query
heads that share its KV head as the rows of one tile, so every K/V element is
read from memory once per request and head group (GQA) and both products run on
tensor cores (``tl.dot`` needs 16 rows, so the group is padded to 16).

Long sequences are cut into splits of ``tokens_per_split`` keys (split-K): each
split writes its partial output, normalised by its own softmax sum, and its
log-sum-exp; a second kernel merges the splits. With one split the first
kernel writes the final output directly.

Scores use base-2 exponentials (``exp2``): the softmax scale is folded with
log2(e) once, on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda.plugins.attention.triton_common import (Tiles, dot_dtype, dot_precision, fp8e4m3_to_float,
                                                    online_softmax_update, reduce_max, reduce_sum)


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, v_scale, tokens_per_split,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_c_kv, stride_c_block, stride_c_head, stride_c_tok,
    stride_po_req, stride_po_head, stride_po_split, stride_pl_req, stride_pl_head,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, IS_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, KV_FP8: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    head = kv_head * GROUP + g  # [G_PAD] query heads of this KV head
    row_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + req * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)  # [G_PAD, D_PAD]

    m = tl.full([G_PAD], float("-inf"), tl.float32)  # running max (log2 domain)
    l = tl.full([G_PAD], 0.0, tl.float32)  # running sum of exp2
    acc = tl.full([G_PAD, D_PAD], 0.0, tl.float32)
    table = block_tables_ptr + req * stride_bt
    head_base = cache_ptr + kv_head * stride_c_head
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)  # [TILE_N] key positions
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_c_block + (pos % BLOCK_SIZE) * stride_c_tok  # [TILE_N]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(head_base + row[:, None] + d[None, :], mask=kv_mask, other=0)  # [TILE_N, D_PAD]
        if KV_FP8:
            k = fp8e4m3_to_float(k)  # stored codes; k_scale is folded into scale_log2
        k = k.to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [G_PAD, TILE_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        p, alpha, m, l = online_softmax_update(s, m, l)
        v = tl.load(head_base + stride_c_kv + row[:, None] + d[None, :], mask=kv_mask, other=0)
        if KV_FP8:
            v = fp8e4m3_to_float(v)  # stored codes; v_scale multiplies the output
        p = p.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)  # rounded to the model dtype, as on the GPU
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=DOT_PRECISION)

    out_mask = row_mask[:, None] & d_mask[None, :]
    if IS_SPLIT:
        # an empty split (past this request's end) leaves l == 0 and reports lse = -inf
        has_keys = l > 0
        out = acc / tl.where(has_keys, l, 1.0)[:, None]
        if KV_FP8:
            out = out * v_scale
        lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), float("-inf"))
        tl.store(part_out_ptr + req * stride_po_req + head[:, None] * stride_po_head + split * stride_po_split
                 + d[None, :], out, mask=out_mask)
        tl.store(part_lse_ptr + req * stride_pl_req + head * stride_pl_head + split, lse, mask=row_mask)
    else:
        out = acc / l[:, None]
        if KV_FP8:
            out = out * v_scale
        tl.store(out_ptr + req * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_po_req, stride_po_head, stride_po_split, stride_pl_req, stride_pl_head,
    stride_ot, stride_oh, num_splits,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < num_splits
    lse = tl.load(part_lse_ptr + req * stride_pl_req + head * stride_pl_head + s, mask=s_mask,
                  other=float("-inf"))  # [SPLITS_PAD]
    weight = tl.exp2(lse - reduce_max(lse, 0))  # empty splits weigh 0; split 0 is never empty
    part = tl.load(part_out_ptr + req * stride_po_req + head * stride_po_head + s[:, None] * stride_po_split
                   + d[None, :], mask=s_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)  # [SPLITS_PAD, D_PAD]
    out = reduce_sum(part * weight[:, None], 0) / reduce_sum(weight, 0)
    tl.store(out_ptr + req * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@dataclass
class DecodePlan:
    """How one step's decodes are cut into splits; buffers are reused by every layer."""

    num_splits: int
    tokens_per_split: int
    part_out: torch.Tensor  # [num_decodes, num_heads, num_splits, head_dim] float32 (empty if one split)
    part_lse: torch.Tensor  # [num_decodes, num_heads, num_splits] float32


def plan_decode(num_decodes: int, max_seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                target_programs: int, min_tokens_per_split: int, tile: int, device: torch.device) -> DecodePlan:
    """Split long sequences so that about ``target_programs`` programs run, never below the minimum split.

    tile: keys per loop iteration; a split is a whole number of them."""
    max_splits = max(1, math.ceil(max_seq_len / max(min_tokens_per_split, tile)))
    wanted = math.ceil(target_programs / max(1, num_decodes * num_kv_heads))
    num_splits = max(1, min(max_splits, wanted))
    tokens_per_split = math.ceil(math.ceil(max_seq_len / num_splits) / tile) * tile
    num_splits = math.ceil(max_seq_len / tokens_per_split)
    if num_splits == 1:
        empty = torch.empty(0, device=device)
        return DecodePlan(1, tokens_per_split, empty, empty)
    part_out = torch.empty(num_decodes, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    part_lse = torch.empty(num_decodes, num_heads, num_splits, dtype=torch.float32, device=device)
    return DecodePlan(num_splits, tokens_per_split, part_out, part_lse)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     out: torch.Tensor, scale: float, plan: DecodePlan, tiles: Tiles, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> None:
    """q, out: [num_decodes, num_heads, head_dim]; kv_cache: [2, num_blocks, num_kv_heads, block_size, head_dim]
    in q's dtype, or uint8 (fp8 e4m3 codes of K / k_scale and V / v_scale);
    block_tables: [num_decodes, max_blocks] int32; seq_lens: [num_decodes] int32."""
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    is_split = plan.num_splits > 1
    po, pl = (plan.part_out, plan.part_lse) if is_split else (out, out)  # unused pointers when not split
    po_strides = (po.stride(0), po.stride(1), po.stride(2)) if is_split else (0, 0, 0)
    pl_strides = (pl.stride(0), pl.stride(1)) if is_split else (0, 0)
    _decode_kernel[(num_decodes, num_kv_heads, plan.num_splits)](
        q, kv_cache, block_tables, seq_lens, out, po, pl,
        scale * k_scale * math.log2(math.e), v_scale, plan.tokens_per_split,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        *po_strides, *pl_strides,
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, TILE_N=tiles.decode_tile_n, IS_SPLIT=is_split,
        DOT_PRECISION=dot_precision(q.dtype), DOT_DTYPE=dot_dtype(q.dtype), KV_FP8=kv_cache.dtype == torch.uint8,
        num_warps=tiles.decode_warps,
    )
    if is_split:
        _merge_splits_kernel[(num_decodes, num_heads)](
            po, pl, out, *po_strides, *pl_strides, out.stride(0), out.stride(1), plan.num_splits,
            SPLITS_PAD=triton.next_power_of_2(plan.num_splits),
            HEAD_DIM=head_dim, D_PAD=d_pad,
        )
