"""The ``cpu`` int kernel: group-wise int4/int8 linears multiplied straight from the packed bits.

Below ``GEMM_MIN_ROWS`` activation rows (decode; ``AVX2_GEMM_MIN_ROWS`` on the
AVX2 path), ``cpu_int_kernels.cpp`` dots the packed integers with the
activations in registers, a tile of output rows per work item, so no
full-precision weight is ever built (see the comment at the top of the C++ file
for the arithmetic). From there on (prefill, large decode batches) it
dequantizes at most ``TILE_ROWS`` rows at a time into one reused buffer for
torch's GEMM; on the AVX2 path, where torch has no fast bf16 GEMM, each thread
dequantizes 128 rows at a time and widens them to fp32 for an fp32 GEMM. It is
compiled on first use (about half a minute) and cached by torch's extension
loader; when that fails (no compiler), layers fall back to the torch path.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from pagoda.host.cpp_extension import load_cpu_extension_or_none
from pagoda.host.env import HostConfig

_SOURCE = Path(__file__).with_name("cpu_int_kernels.cpp")

# implementation selector passed to the C++ kernel
IMPL_AUTO, IMPL_SCALAR = 0, 1
# From this many activation rows on, tiles of dequantized rows go through torch's GEMM. Measured on
# this model's four linears x 30 layers (group 64, bf16, one thread), ms per pass, direct / GEMM path
# / bf16 F.linear in the same run: 1 row 5.8 / 20.3 / 17.5; 4 rows 14.0 / 21.3 / 18.0; 6 rows
# 20.0 / 22.8 / 18.7; 8 rows 24.8 / 23.3 / 19.6; 16 rows - / 25.8 / 23.2; 64 rows - / 50.3 / 46.4.
GEMM_MIN_ROWS = 8
# The same crossover on the AVX2 path (fp32 FMAs on 8 lanes; the GEMM path widens tiles to fp32 for an
# fp32 GEMM), forced AVX2 on this machine, one thread, ms per pass, direct / GEMM path: 12 rows 69 / 80;
# 13 rows 89 / 80; 16 rows 97 / 81; 31 rows 183 / 111; 64 rows 377 / 183; 150 rows 815 / 427.
AVX2_GEMM_MIN_ROWS = 13
# Rows per dequantized tile on the GEMM path: torch's GEMM has a fixed cost per call (256-row tiles
# cost 40% more than 1024 at 16 rows) and one tile covering a whole layer is multiplied straight
# into the output (4096 vs 1024 here: 32.7 vs 35.2 ms at 16 rows, 157 vs 160 at 256); the buffer is
# at most 4096 x in_features in the model dtype (3.5 MB for this model's gate_up).
TILE_ROWS = 4096


def int_kernels_or_none(host: Optional[HostConfig] = None) -> Optional[Any]:
    """The compiled kernel (once per machine and ISA level) as an engine's host settings build it (None: the
    environment's), or None (with one warning) when it cannot be built here."""
    return load_cpu_extension_or_none("pagoda_cpu_int_linear", _SOURCE,
                                      fallback="the slower torch path of quantized layers", host=host)


def isa_path(host: Optional[HostConfig] = None) -> str:
    """The ISA path of the int kernel's small-batch product (``avx512_bf16``, ``avx512``, ``avx2``, ``scalar``),
    or ``torch`` where it cannot be built."""
    kernels = int_kernels_or_none(host)
    return str(kernels.isa_path()) if kernels is not None else "torch"


@lru_cache(maxsize=None)
def default_gemm_min_rows(kernels: Any) -> int:
    """Activation rows from which ``kernels`` take their GEMM path, by their ISA path."""
    return AVX2_GEMM_MIN_ROWS if str(kernels.isa_path()) == "avx2" else GEMM_MIN_ROWS


def cpu_int_linear(kernels: Any, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor],
                   impl: int = IMPL_AUTO, gemm_min_rows: Optional[int] = None,
                   tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """``x [..., in] -> [..., out]`` for a layer in the int runtime layout (see ``int_linear.py``);
    ``gemm_min_rows`` None: :func:`default_gemm_min_rows`."""
    if gemm_min_rows is None:
        gemm_min_rows = default_gemm_min_rows(kernels)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [M, in]
    y = torch.empty(x2.shape[0], layer.out_features, dtype=x.dtype)  # [M, out]
    for i, (row_start, row_end, has_perm) in enumerate(layer.int_parts):
        perm = getattr(layer, f"w_perm_{i}") if has_perm else None
        kernels.int_linear_rows(x2, layer.w_q, layer.w_scales, layer.w_zeros, perm, layer.int_bits,
                                layer.int_group_size, row_start, row_end, y, bias, impl,
                                gemm_min_rows, tile_rows)
    return y.view(*lead, layer.out_features)
