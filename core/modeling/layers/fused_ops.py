"""Fused CPU kernels for the decoder layer's elementwise work (RMSNorm, SiLU- and GELU-tanh-and-mul, RoPE, and
per-head q/k RMSNorm with RoPE in one pass), and bf16 linears.

The elementwise kernels run 8 lanes of intrinsics on AVX2 and the compiler's vectorised loops on AVX-512. bf16
linears take a GEMV for decode-sized batches (AVX-512 BF16 dot products, or fp32 math on AVX2) and, on AVX2, an
fp32 GEMM over widened weight tiles for larger ones (blocked by activation rows for prefill-sized ones); in the
batch-invariant mode, and where the ``cpu_linear_kernel`` host setting picks it, the packed GEMM of
``invariant_gemm.cpp`` over weights packed for it at load time. The kernels are
compiled on first use (about a minute, then cached by torch's extension loader). Where they cannot be built, or
for tensors they do not cover (GPU, other dtypes, odd strides), the layers fall back to plain torch ops that
compute the same values. An engine's ``fused_cpu_ops`` host setting off (``--no-fused-cpu-ops``,
``PAGODA_FUSED_CPU_OPS=0``) turns the kernels off for its model: its layers hold a ``CpuKernels`` chosen from its
settings when it is built.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from pagoda.host.cpp_extension import load_cpu_extension_or_none
from pagoda.host.cpu_isa import cpu_isa
from pagoda.host.env import HostConfig, resolve_host_config
from pagoda.modeling.layers import onednn


_SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_INVARIANT_SOURCE = Path(__file__).with_name("invariant_gemm.cpp")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Up to this many rows, the GEMV kernel beats torch's bf16 matmul here (one thread, the model's shapes with
# weights streamed from memory: 20-24 ms against 36-46 ms per decode step at 1 row, 32-42 against 40-52 at 4,
# 44-61 against 35-43 at 8).
GEMV_MAX_ROWS = 4

# Without bf16 math (the AVX2 build), torch's bf16 matmul widens on the fly and falls far behind fp32 beyond a
# few rows. There the GEMV (fp32 math in registers) takes up to AVX2_GEMV_MAX_ROWS rows and the widened-tile
# fp32 GEMM the rest. The default model's 30 layers and LM head, 2 threads, capped to AVX2, per step:
# 1 row 3.6 ms (fp32 weights: 10.9), 8 rows 16.7 (18.9), 16 rows: GEMV 32, tiled GEMM 25 (fp32: 22),
# 64 rows: tiled GEMM 50-56 (fp32: 44; torch's bf16 matmul: 141).
AVX2_GEMV_MAX_ROWS = 8

# From this many rows (prefill chunks) the AVX2 path takes the row-blocked GEMM instead: the weights widened in
# chunks both threads share, the threads taking blocks of activation rows (``gemm_bf16_fp32_rows``). The default
# model's four linear shapes, 2 threads, AVX2 EPYC, time of the row-blocked GEMM over the widened-tile one:
# 1.23-1.25x at 128 rows, 0.98-1.09x at 512-768, 0.87x at 1,024, 0.83x at 1,536, 0.71x at 2,048 (widening the
# whole weight and calling torch's fp32 linear: 1.57x, 1.10-1.26x, 1.01x, 0.92x, 0.88x).
AVX2_ROWS_GEMM_MIN_ROWS = 1024
# activation rows per block of the row-blocked GEMM, and the widened weight chunk it multiplies them by: up to
# this many bytes of fp32 (1,024 rows of the default model's 576 columns), so it stays in the shared cache
ROWS_GEMM_BLOCK = 256
ROWS_GEMM_CHUNK_BYTES = 1024 * 576 * 4

# The ISA levels on which ``cpu_linear_kernel=auto`` runs the default mode's bf16 linears through the packed GEMM
# of ``invariant_gemm.cpp`` instead of oneDNN's packed GEMM (AVX-512) or the GEMV and widened-tile GEMM (AVX2).
# Measured on AMD Zen 5 (one thread, the default model's four linear shapes, CPU time), packed over the other:
# AVX-512 BF16 0.68-0.79x at 1-32 rows, 0.93x at 128, 0.99x at 512; capped to AVX2 0.52-0.69x at 1-32 rows,
# 0.86-0.87x at 128-512; whole W3 and W1 runs at 2 threads in process CPU time: see docs/serving_speed.md.
# ``avx512`` without BF16 (the packed GEMM's FMA path against oneDNN's) was not measured: it keeps oneDNN.
PACKED_GEMM_AUTO_ISAS: tuple[str, ...] = ("avx2", "avx512_bf16")

# The batch-invariant mode's rows per matmul where its bf16 GEMM does not apply (float32 or float16 weights, no
# kernels): every product is a [16, K] tile, the last one padded with zero rows, so the BLAS picks the same kernel
# whatever the batch. Measured here (AVX2, MKL, 1 and 2 threads): a row's output bits did not depend on its place
# in the tile nor on the other rows, while a 1-row and a 16-row product differed in 5-90% of the outputs.
INVARIANT_TILE_ROWS = 16


def rows_gemm_chunk(in_features: int) -> int:
    """Weight rows per widened chunk of the row-blocked GEMM for ``in_features`` columns: a multiple of 16, at
    least 64, at most ``ROWS_GEMM_CHUNK_BYTES`` of fp32."""
    return max(64, ROWS_GEMM_CHUNK_BYTES // (4 * max(1, in_features)) // 16 * 16)


def cpu_ops(host: Optional[HostConfig] = None) -> Optional[Any]:
    """The compiled kernels for ``host`` (an engine's settings; None: the environment's), or None when its
    ``fused_cpu_ops`` setting is off or they cannot be built."""
    host = host if host is not None else resolve_host_config()
    if not host.fused_cpu_ops:
        return None
    # no FMA contraction: products round as torch's do
    return load_cpu_extension_or_none("pagoda_cpu_ops", _SOURCE, ("-ffp-contract=off",), fallback="torch ops",
                                      host=host)


def linear_kernel(host: HostConfig) -> str:
    """The default mode's bf16 linear kernel for ``host``: its ``cpu_linear_kernel`` setting, ``auto`` resolved
    to ``packed`` (pagoda's packed GEMM) on the ISA levels of ``PACKED_GEMM_AUTO_ISAS``, else ``onednn``."""
    if host.cpu_linear_kernel != "auto":
        return host.cpu_linear_kernel
    return "packed" if cpu_isa(host.cpu_isa) in PACKED_GEMM_AUTO_ISAS else "onednn"


def _packable(weight: torch.Tensor) -> bool:
    """Whether the packed GEMM takes ``weight``: a bf16 ``[out, in]`` CPU matrix."""
    return weight.dtype == torch.bfloat16 and weight.is_cpu and weight.dim() == 2


def invariant_gemm_ops(host: HostConfig) -> Optional[Any]:
    """The packed bf16 GEMM (``invariant_gemm.cpp``) for ``host``, or None when its
    ``fused_cpu_ops`` setting is off, the build has no path for this CPU (neither AVX-512 BF16 nor AVX2 + FMA) or
    it cannot be built."""
    if not host.fused_cpu_ops:
        return None
    ops = load_cpu_extension_or_none("pagoda_invariant_gemm", _INVARIANT_SOURCE, ("-ffp-contract=off",),
                                     fallback="torch ops in fixed tiles", host=host)
    return ops if ops is not None and ops.path() else None


class CpuKernels:
    """The CPU kernels one model's layers run, chosen once, from its engine's host settings, when the model is
    built: every layer holds the model's ``CpuKernels`` and asks it, so engines with other settings in the same
    process run their own. ``CpuKernels()`` (no settings) runs plain torch ops."""

    def __init__(self, host: Optional[HostConfig] = None, batch_invariant: bool = False) -> None:
        """``batch_invariant``: every row of a linear's output computed in an order that depends on nothing but
        that row (:meth:`linear`), for the engine's batch-invariant mode."""
        self.ops = cpu_ops(host) if host is not None else None
        # the ISA path of the compiled bf16 GEMV: ``avx512_bf16``, ``avx2``, or ``""`` (none, or turned off)
        self.gemv_path = str(self.ops.gemv_path()) if self.ops is not None else ""
        self.batch_invariant = batch_invariant
        # pagoda's packed bf16 GEMM (``invariant_gemm.cpp``): the batch-invariant mode's (see
        # :meth:`invariant_linear`), and the default mode's where the ``cpu_linear_kernel`` setting picks it
        wants_gemm = host is not None and (batch_invariant or linear_kernel(host) == "packed")
        self.packed_gemm_ops = invariant_gemm_ops(host) if wants_gemm else None
        # bf16 linears multiply weights packed for that GEMM (without it the default mode keeps its own kernels)
        self.uses_packed_gemm = batch_invariant or self.packed_gemm_ops is not None
        # bf16 weights are packed at load time: for the packed GEMM, or else in oneDNN's blocked layout (see
        # layers.onednn; not in the batch-invariant mode: oneDNN picks its kernel by the number of rows)
        self.packs_weights = host is not None and (self.packed_gemm_ops is not None if self.uses_packed_gemm
                                                   else onednn.packing_available(host))
        # the product with a weight :meth:`pack_weight` packed: ``(x, packed, bias=None) -> y``
        self.packed_linear = self._packed_gemm_linear if self.uses_packed_gemm else onednn.packed_linear
        # within a step that computes prompt tokens (:meth:`prompt_step`), on AVX2, bf16 linears take the GEMM at
        # every row count: a prompt's rows then come out the same bits however the prompt was split into steps
        # (a prefix-cache hit, a chunk), since each GEMM row's sums depend on that row alone
        self.in_prompt_step = False

    @contextlib.contextmanager
    def prompt_step(self) -> Iterator[None]:
        """Within the block, the forward pass computes prompt tokens (see ``in_prompt_step``)."""
        self.in_prompt_step = True
        try:
            yield
        finally:
            self.in_prompt_step = False

    def for_tensor(self, t: torch.Tensor) -> Optional[Any]:
        """The kernels if they cover ``t`` (a CPU tensor of a supported dtype), else None."""
        if self.ops is None or not t.is_cpu or t.dtype not in _DTYPES:
            return None
        return self.ops

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension."""
        ops = self.for_tensor(gate_up)
        if ops is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
            return ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up`` for ``gate_up = [gate | up]`` along the last dimension
        (Gemma's MLP)."""
        ops = self.for_tensor(gate_up)
        if ops is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
            return ops.gelu_tanh_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up

    def qk_norm_rotary_(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                        num_heads: int, num_kv_heads: int, head_dim: int,
                        tables: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> bool:
        """Per-head RMSNorm of the q and k heads of ``qkv [T, (H + 2 Hkv) * D]`` (weights ``[D]``), then their
        rotary embedding by ``tables`` (cos and sin ``[max_position, D]`` in qkv's dtype, int64 positions ``[T]``;
        None: no rotation), in place, by one kernel: the values of the RMSNorm kernel on q and k followed by the
        rotary kernel. Returns False, changing nothing, where the kernel does not apply."""
        ops = self.for_tensor(qkv)
        if ops is None or qkv.dim() != 2 or qkv.stride(1) != 1 or q_weight.dtype != qkv.dtype:
            return False
        if tables is not None and tables[0].dtype != qkv.dtype:
            return False
        ops.qk_norm_rotary_(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim, *(tables or ()))
        return True

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``F.linear``; for bf16 on a CPU, through the GEMV kernel for decode-sized batches, and without bf16
        math (AVX2) through the widened-tile GEMM for larger ones and for prompt tokens (:meth:`prompt_step`), and the
        row-blocked one for prefill-sized ones. Batch-invariant: see :meth:`invariant_linear`."""
        if self.batch_invariant:
            return self.invariant_linear(x, weight, bias)
        if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
                and weight.is_contiguous()):
            path = self.gemv_path
            rows = x.numel() // max(1, x.shape[-1])
            if path == "avx512_bf16" and rows <= GEMV_MAX_ROWS or path == "avx2":
                x2 = x.reshape(rows, x.shape[-1])
                if x2.stride(-1) == 1:
                    if path == "avx2" and rows >= AVX2_ROWS_GEMM_MIN_ROWS:
                        y = self.ops.gemm_bf16_fp32_rows(x2, weight, bias, ROWS_GEMM_BLOCK,
                                                         rows_gemm_chunk(weight.shape[1]))
                    elif path == "avx2" and (rows > AVX2_GEMV_MAX_ROWS or self.in_prompt_step):
                        y = self.ops.gemm_bf16_fp32(x2, weight, bias)
                    else:
                        y = self.ops.gemv_bf16(x2, weight, bias)
                    return y.view(*x.shape[:-1], weight.shape[0])
        return torch.nn.functional.linear(x, weight, bias)

    def invariant_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
                         ) -> torch.Tensor:
        """``F.linear`` in which each output row's bits depend on that input row alone, not on how many rows
        come with it nor where it sits: bf16 through the invariant GEMM (each output accumulates its K in order
        in one fp32 lane; see ``invariant_gemm.cpp``), the weight packed for the call (a layer packs its weight
        once, at load time: :meth:`pack_weight`, :attr:`packed_linear`); other dtypes, or without the kernel, in
        fixed tiles of ``INVARIANT_TILE_ROWS`` rows."""
        if self.packed_gemm_ops is not None and x.dtype == torch.bfloat16 and x.is_cpu and _packable(weight):
            return self._packed_gemm_linear(x, self.packed_gemm_ops.pack_bf16(weight.contiguous()), bias)
        rows, k = x.numel() // max(1, x.shape[-1]), x.shape[-1]
        x2 = x.reshape(rows, k)
        tile = INVARIANT_TILE_ROWS
        padded = x2.new_zeros((-(-rows // tile) * tile, k))
        padded[:rows] = x2
        y = torch.cat([torch.nn.functional.linear(padded[i:i + tile], weight, bias)
                       for i in range(0, padded.shape[0], tile)])[:rows]
        return y.view(*x.shape[:-1], weight.shape[0])

    def _packed_gemm_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None
                                 ) -> torch.Tensor:
        """``F.linear`` over a weight packed for the invariant GEMM (``[N, ceil(K / 2), 2]``); ``x`` bf16 of any
        leading shape."""
        x2 = x.reshape(-1, x.shape[-1])
        y = self.packed_gemm_ops.gemm_bf16(x2 if x2.stride(-1) == 1 else x2.contiguous(), packed, bias)
        return y.view(*x.shape[:-1], packed.shape[0])

    def pack_weight(self, weight: torch.Tensor) -> Optional[torch.Tensor]:
        """``weight`` ``[out, in]`` packed for :attr:`packed_linear` where this model packs it (a bf16 CPU
        matrix): in oneDNN's blocked layout (see layers.onednn), or in the batch-invariant mode the invariant
        GEMM's (``[out, ceil(in / 2), 2]``, a plain tensor); else None."""
        if not self.packs_weights:
            return None
        if self.uses_packed_gemm:
            return self.packed_gemm_ops.pack_bf16(weight.contiguous()) if _packable(weight) else None
        return onednn.pack_weight(weight)

    def isa_paths(self, dtype: torch.dtype) -> dict[str, str]:
        """The ISA path the decoder layer's elementwise kernels and dense linear layers take for a CPU model
        of ``dtype`` (for benchmarks and logs)."""
        elementwise = str(self.ops.elementwise_path()) if self.ops is not None and dtype in _DTYPES else "torch"
        if self.batch_invariant:
            dense = (f"batch-invariant: packed bf16 GEMM ({self.packed_gemm_ops.path()}), each output's sum in one lane"
                     if dtype == torch.bfloat16 and self.packed_gemm_ops is not None else
                     f"batch-invariant: torch in fixed tiles of {INVARIANT_TILE_ROWS} rows")
        elif dtype != torch.bfloat16:
            dense = "torch"
        elif self.packed_gemm_ops is not None:
            dense = f"packed bf16 GEMM ({self.packed_gemm_ops.path()})"
        elif self.packs_weights:
            dense = "onednn packed bf16 (the LM head too)"
        elif self.gemv_path == "avx2":
            dense = (f"avx2 (gemv up to {AVX2_GEMV_MAX_ROWS} rows, fp32 GEMM of widened tiles beyond, "
                     f"row-blocked from {AVX2_ROWS_GEMM_MIN_ROWS})")
        elif self.gemv_path:
            dense = f"gemv {self.gemv_path} up to {GEMV_MAX_ROWS} rows, torch beyond"
        else:
            dense = "torch"
        return {"rmsnorm/silu/rope": elementwise, "dense linear": dense}
