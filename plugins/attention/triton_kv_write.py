"""Triton kernel: scatter this step's K/V into their paged slots.

KV layout (shared by the ``triton`` and ``cuda`` backends):
``[2, num_blocks, num_kv_heads, block_size, head_dim]``. One program writes
every KV head of TOKENS consecutive tokens; a slot of -1 (a padding token) is
skipped. An fp8 cache (passed as its uint8 view) stores e4m3 codes of k / k_scale
and v / v_scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.plugins.attention.triton_backend import interpreting
from pagoda.plugins.attention.triton_common import float_to_fp8e4m3


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, num_tokens, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_block, stride_c_head, stride_c_tok,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, KV_FP8: tl.constexpr,
):
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)  # [TOKENS]
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    safe_slot = tl.where(slot >= 0, slot, 0)  # masked lanes still form addresses: keep them in bounds
    block = safe_slot // BLOCK_SIZE
    offset = safe_slot % BLOCK_SIZE
    c = tl.arange(0, HEADS_PAD * D_PAD)  # one column per (KV head, dim)
    h = c // D_PAD
    d = c % D_PAD
    mask = (slot >= 0)[:, None] & ((h < NUM_KV_HEADS) & (d < HEAD_DIM))[None, :]  # [TOKENS, HEADS_PAD * D_PAD]
    dst = cache_ptr + (block * stride_c_block + offset * stride_c_tok)[:, None] + (h * stride_c_head + d)[None, :]
    k = tl.load(k_ptr + t[:, None] * stride_kt + (h * stride_kh + d)[None, :], mask=mask)
    if KV_FP8:
        k = float_to_fp8e4m3(k.to(tl.float32) / k_scale)
    tl.store(dst, k, mask=mask)
    v = tl.load(v_ptr + t[:, None] * stride_vt + (h * stride_vh + d)[None, :], mask=mask)
    if KV_FP8:
        v = float_to_fp8e4m3(v.to(tl.float32) / v_scale)
    tl.store(dst + stride_c_kv, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64, -1 = skip.
    kv_cache: the model dtype, or uint8 (the bytes of an fp8 e4m3 cache: k / k_scale, v / v_scale)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    d_pad, heads_pad = triton.next_power_of_2(head_dim), triton.next_power_of_2(num_kv_heads)
    # about 1K elements (8 per thread) per program on a GPU; the interpreter pays per program, so it takes more
    tokens = 64 if interpreting() else max(1, 1024 // (d_pad * heads_pad))
    _kv_write_kernel[(triton.cdiv(num_tokens, tokens),)](
        k, v, kv_cache, slot_mapping, num_tokens, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, D_PAD=d_pad, HEADS_PAD=heads_pad,
        BLOCK_SIZE=kv_cache.shape[3], TOKENS=tokens, KV_FP8=kv_cache.dtype == torch.uint8,
    )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
