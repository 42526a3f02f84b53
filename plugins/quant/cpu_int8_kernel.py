"""W8A8 matmul: int8 weights with one scale per output channel, int8 activations with one scale per token.

The layer keeps its weight packed for the C++ kernel (``cpu_int8_kernels.cpp``; the layout is described
at its top): ``w8_packed`` int8 ``[N_pad / 16, K_pad * 16]``, ``w8_colsum`` int32 ``[N_pad]`` (each row's
sum of weights, for the VNNI paths' +128 activation shift) and ``w8_scale`` float32 ``[N_pad]``
(``N_pad``/``K_pad``: N and K rounded up to 16 and 4, padded with zeros). Activations are quantized
symmetrically per token inside the kernel: ``s = max|x| / 127``, ``q = round(x / s)`` in [-127, 127].
``int8_linear_reference`` computes the same arithmetic with torch (exact integer sums in float64): the
``torch`` kernel choice, the fallback where the C++ kernel cannot be built or the input is not on a CPU,
and the tests' reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from pagoda.host.cpp_extension import load_cpu_extension_or_none
from pagoda.host.env import HostConfig

_SOURCE = Path(__file__).with_name("cpu_int8_kernels.cpp")
# exact float rounding in the epilogue ((sum * s_x) * s_w + bias, never fused into an FMA), as in the reference
CFLAGS = ("-ffp-contract=off",)
BLOCK_ROWS, DEPTH = 16, 4  # output rows per packed block, input columns per 32-bit lane
IMPL_AUTO, IMPL_SCALAR = 0, 1


def int8_kernels_or_none(host: Optional[HostConfig] = None) -> Optional[Any]:
    """The compiled kernel (once per machine and ISA level) as an engine's host settings build it (None: the
    environment's), or None (with one warning) when it cannot be built here."""
    return load_cpu_extension_or_none("pagoda_cpu_int8_linear", _SOURCE, CFLAGS,
                                      fallback="the slower torch path of W8A8 layers", host=host)


def isa_path(host: Optional[HostConfig] = None) -> str:
    """The W8A8 kernel's ISA path (``avx512_vnni``, ``avx_vnni``, ``avx2``, ``scalar``), or ``torch`` where it
    cannot be built."""
    kernels = int8_kernels_or_none(host)
    return str(kernels.isa_path()) if kernels is not None else "torch"


def pack_int8_weight(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``q [N, K]`` -> (``w8_packed [N_pad / 16, K_pad * 16]``, ``w8_colsum`` int32 ``[N_pad]``)."""
    n, k = q.shape
    n_pad, k_pad = -(-n // BLOCK_ROWS) * BLOCK_ROWS, -(-k // DEPTH) * DEPTH
    q = F.pad(q, (0, k_pad - k, 0, n_pad - n))
    colsum = q.sum(dim=1, dtype=torch.int32)
    # [N_pad / 16, 16, K_pad / 4, 4] -> [N_pad / 16, K_pad / 4, 16, 4]: 4 columns of 16 rows per 64 bytes
    packed = q.view(n_pad // BLOCK_ROWS, BLOCK_ROWS, k_pad // DEPTH, DEPTH).permute(0, 2, 1, 3)
    return packed.reshape(n_pad // BLOCK_ROWS, k_pad * BLOCK_ROWS).contiguous(), colsum


def unpack_int8_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int8 ``[n, k]`` weight back from ``w8_packed``."""
    blocks, width = packed.shape
    k_pad = width // BLOCK_ROWS
    q = packed.view(blocks, k_pad // DEPTH, BLOCK_ROWS, DEPTH).permute(0, 2, 1, 3).reshape(blocks * BLOCK_ROWS, k_pad)
    return q[:n, :k]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (int8 ``q [M, K]``, float32 ``s [M, 1]``): ``s = max|x| / 127``, ``q = round(x / s)``."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True) / 127.0  # [M, 1]
    q = torch.where(s > 0, torch.round(xf / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
    return q.to(torch.int8), s


def int8_linear_reference(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor,
                          bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` with the kernel's arithmetic; ``q_weight`` int8 ``[N, K]``, ``w_scale [N]``."""
    lead = x.shape[:-1]
    q, s = quantize_per_token(x.reshape(-1, x.shape[-1]))
    sums = (q.double() @ q_weight.double().T).float()  # exact: |sum| <= 127 * 128 * K < 2 ** 53
    y = (sums * s) * w_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*lead, q_weight.shape[0])


def cpu_int8_linear(kernels: Any, x: torch.Tensor, packed: torch.Tensor, colsum: torch.Tensor,
                    w_scale: torch.Tensor, out_features: int, bias: Optional[torch.Tensor],
                    impl: int = IMPL_AUTO) -> torch.Tensor:
    """``x [..., K] -> [..., out_features]`` through the C++ kernel (``bias`` float32 or None)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]
    y = torch.empty(x2.shape[0], out_features, dtype=x.dtype)  # [M, N]
    if x2.shape[0]:
        kernels.int8_linear(x2, packed, colsum, w_scale, bias, y, impl)
    return y.view(*lead, out_features)
