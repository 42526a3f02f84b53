"""Triton varlen prefill / chunked-prefill attention over paged K/V.

A request's new tokens attend to its cached prefix and causally to each
other. The new K/V are written to the cache before this kernel runs, so every
key comes through the block table and a chunk with context is no different
from a fresh prompt. No padding: the flattened queries are cut into tiles of
TILE_Q tokens per request on the host (``plan_prefill``), and one program
runs per (tile, KV head).

A program's rows are its TILE_Q tokens times the G_PAD query heads that share
the KV head (row r = token r // G_PAD, head r % G_PAD), so each K/V tile is
loaded once for the whole head group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from pagoda.plugins.attention.triton_common import (Tiles, dot_dtype, dot_precision, fp8e4m3_to_float,
                                                    online_softmax_update)


@triton.jit
def _prefill_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tile_req_ptr, tile_q0_ptr, out_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_c_kv, stride_c_block, stride_c_head, stride_c_tok, v_scale,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, TILE_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, KV_FP8: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)  # first query of this tile, counted within the request
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # tokens cached before this step

    r = tl.arange(0, TILE_Q * G_PAD)
    tok = q0 + r // G_PAD
    g = r % G_PAD
    head = kv_head * GROUP + g
    row_mask = (tok < q_len) & (g < GROUP)
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0.0).to(DOT_DTYPE)  # [TILE_Q * G_PAD, D_PAD]
    q_pos = ctx_len + tok  # absolute position of each row's token

    m = tl.full([TILE_Q * G_PAD], float("-inf"), tl.float32)
    l = tl.full([TILE_Q * G_PAD], 0.0, tl.float32)
    acc = tl.full([TILE_Q * G_PAD, D_PAD], 0.0, tl.float32)
    table = block_tables_ptr + req * stride_bt
    head_base = cache_ptr + kv_head * stride_c_head
    kv_end = tl.minimum(seq_len, ctx_len + q0 + TILE_Q)  # causal: no row of the tile sees past this
    for tile_start in range(0, kv_end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        valid = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_c_block + (pos % BLOCK_SIZE) * stride_c_tok
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(head_base + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [TILE_N, D_PAD]
        if KV_FP8:
            k = fp8e4m3_to_float(k)  # stored codes; k_scale is folded into scale_log2
        k = k.to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [rows, TILE_N]
        # key 0 is visible to every row, so no row's running max stays -inf after the first tile
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        p, alpha, m, l = online_softmax_update(s, m, l)
        v = tl.load(head_base + stride_c_kv + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            v = fp8e4m3_to_float(v)  # stored codes; v_scale multiplies the output
        p = p.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)  # rounded to the model dtype, as on the GPU
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=DOT_PRECISION)

    if KV_FP8:
        out = acc * (v_scale / l)[:, None]
    else:
        out = acc / l[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


@dataclass
class PrefillPlan:
    """The query tiles of one step's prefill requests; shared by every layer."""

    num_tiles: int
    tile_q: int
    tile_req: torch.Tensor  # [num_tiles] int32, request index in the batch
    tile_q0: torch.Tensor  # [num_tiles] int32, first query token of the tile within its request


def plan_prefill(query_lens: np.ndarray, first_req: int, group: int, tiles: Tiles, device: torch.device) -> PrefillPlan:
    """query_lens: [num_prefills] new tokens of requests first_req, first_req + 1, ..."""
    tile_q = max(1, tiles.prefill_rows // triton.next_power_of_2(group))  # query tokens per program
    tiles_per_req = -(-query_lens // tile_q)
    tile_req = np.repeat(np.arange(first_req, first_req + len(query_lens)), tiles_per_req)
    # tile index within its request, times tile_q
    starts = np.cumsum(tiles_per_req) - tiles_per_req
    tile_q0 = (np.arange(len(tile_req)) - np.repeat(starts, tiles_per_req)) * tile_q
    return PrefillPlan(
        num_tiles=len(tile_req),
        tile_q=tile_q,
        tile_req=torch.from_numpy(tile_req.astype(np.int32)).to(device),
        tile_q0=torch.from_numpy(tile_q0.astype(np.int32)).to(device),
    )


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, out: torch.Tensor, scale: float, plan: PrefillPlan,
                      tiles: Tiles, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """q, out: [num_tokens, num_heads, head_dim] (the whole batch; only planned tiles are touched);
    kv_cache in q's dtype, or uint8 (fp8 e4m3 codes of K / k_scale and V / v_scale);
    block_tables: [num_reqs, max_blocks] int32; seq_lens: [num_reqs]; query_start_loc: [num_reqs + 1]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    _prefill_kernel[(plan.num_tiles, num_kv_heads)](
        q, kv_cache, block_tables, seq_lens, query_start_loc, plan.tile_req, plan.tile_q0, out,
        scale * k_scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), v_scale,
        GROUP=group, G_PAD=triton.next_power_of_2(group), TILE_Q=plan.tile_q, HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, TILE_N=tiles.prefill_tile_n,
        DOT_PRECISION=dot_precision(q.dtype), DOT_DTYPE=dot_dtype(q.dtype), KV_FP8=kv_cache.dtype == torch.uint8,
        num_warps=tiles.prefill_warps,
    )
