"""Triton dequantize-and-multiply for pagoda's runtime int layout (see ``int_linear.py``).

One program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y = x @ W^T``,
unpacking the 4- or 8-bit weights of each ``[BLOCK_K, BLOCK_N]`` slice and
applying its group's zero point and scale in registers, so the full-precision
weight never exists in memory. Runs on GPUs, and on a CPU under
``TRITON_INTERPRET=1`` (how the tests check it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int_dequant_matmul_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_ym, HALF,
    GROUP: tl.constexpr, BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] token rows
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output channels
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K] input columns
        x_mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=x_mask, other=0.0).to(tl.float32)
        w_mask = (rk[:, None] < K) & (rn[None, :] < N)
        if BITS == 4:
            # byte k of a row: column k in the low nibble, column k + HALF in the high one
            is_high = rk[:, None] >= HALF
            byte_idx = tl.where(is_high, rk[:, None] - HALF, rk[:, None])
            byte = tl.load(q_ptr + rn[None, :] * stride_qn + byte_idx, mask=w_mask, other=0).to(tl.int32)
            q = (byte >> (is_high.to(tl.int32) * 4)) & 0xF
        else:
            q = tl.load(q_ptr + rn[None, :] * stride_qn + rk[:, None], mask=w_mask, other=0).to(tl.int32)
        g = rk[:, None] // GROUP  # [BLOCK_K, 1] group of each input column
        s = tl.load(s_ptr + rn[None, :] * stride_sn + g, mask=w_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rn[None, :] * stride_sn + g, mask=w_mask, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - z) * s  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w)
    y_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def int_dequant_matmul(x: torch.Tensor, layer: torch.nn.Module, row_start: int, row_end: int) -> torch.Tensor:
    """``x [..., in] @ W[row_start:row_end]^T`` straight from the packed weight; returns ``[..., rows]``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]
    q = layer.w_q[row_start:row_end]
    scales = layer.w_scales[row_start:row_end]
    zeros = layer.w_zeros[row_start:row_end]
    m, k = x2.shape
    n = q.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = 16, 32, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int_dequant_matmul_kernel[grid](
        x2, q, scales, zeros, y, m, n, k,
        x2.stride(0), q.stride(0), scales.stride(0), y.stride(0), q.shape[1],
        GROUP=layer.int_group_size, BITS=layer.int_bits,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y.view(*lead, n)
