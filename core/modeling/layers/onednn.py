"""bf16 linear weights held in oneDNN's blocked layout on a CPU.

``F.linear`` on a bf16 CPU weight hands oneDNN a plain ``[out, in]`` matrix, and
oneDNN copies it into the blocked layout its AMX / AVX-512 kernels read on
every call: each matmul reads the weight twice and writes it once. Packing once
at load time removes that copy. The product is bit-identical to ``F.linear``
(checked for every batch size and bias tested; see tests/test_onednn_linear.py).

Measured here, 2 threads, the default model's 30 layers and LM head with
weights streamed from memory, per decode step: 1 row 15.6 -> 9.9 ms (the GEMV
kernel in fused_ops: 11.0), 8 rows 17.9 -> 10.4, 16 rows 17.2 -> 12.2, 64 rows
34.5 -> 29.2, 128 rows 55.3 -> 48.2.

Only bf16: a packed float32 weight rounds differently from ``F.linear`` (which
would break float32 parity with HF transformers), and packed fp16 needs
AVX512-FP16. An engine's ``onednn_packed_weights`` host setting off
(``--no-onednn-packed-weights``, ``PAGODA_ONEDNN_PACKED=0``) keeps its weights plain.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Optional

import torch

from pagoda.host.cpu_isa import cpu_isa
from pagoda.host.env import HostConfig

logger = logging.getLogger(__name__)

# the batch size oneDNN is told to expect; the layout it picks did not depend on it here (1 to 2048 rows
# ran at the same speed packed for 1, 16, 64 or 2048)
_BATCH_HINT = 64


def packing_available(settings: HostConfig) -> bool:
    """Whether an engine with these host settings packs bf16 weights: its ``onednn_packed_weights`` setting is
    on, its ISA level is AVX-512 and a small product reproduces ``F.linear`` here (checked once)."""
    if not settings.onednn_packed_weights:
        return False
    # torch routes bf16 matmuls to oneDNN only on AVX-512 CPUs; below that (or capped below it) F.linear
    if cpu_isa(settings.cpu_isa) not in ("avx512", "avx512_bf16"):
        return False
    return _packing_reproduces_linear()


@lru_cache(maxsize=1)
def _packing_reproduces_linear() -> bool:
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=gen).to(torch.bfloat16)
        x = torch.randn(5, 40, generator=gen).to(torch.bfloat16)
        b = torch.randn(48, generator=gen).to(torch.bfloat16)
        got = packed_linear(x, torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT), b)
    except RuntimeError as exc:  # no bf16 support in this CPU's oneDNN path
        logger.info("oneDNN packed bf16 weights unavailable (%s); using F.linear", exc)
        return False
    if not torch.equal(got, torch.nn.functional.linear(x, w, b)):
        logger.warning("oneDNN packed bf16 weights do not reproduce F.linear here; using F.linear")
        return False
    return True


def pack_weight(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """``weight`` ``[out, in]`` in oneDNN's blocked layout (an opaque mkldnn tensor), or None where packing
    does not apply (not bf16, not on a CPU, or unsupported here). Whether a model packs at all is its engine's
    choice (``packing_available``, asked by ``fused_ops.CpuKernels``)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if not _packing_reproduces_linear():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``packed = pack_weight(W)``; ``x`` bf16 of any leading shape."""
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")


def is_packed(t: torch.Tensor) -> bool:
    return t.is_mkldnn


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A plain ``[out, in]`` tensor of a weight, packed or not."""
    return weight.to_dense() if weight.is_mkldnn else weight
