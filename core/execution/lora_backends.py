"""The built-in LoRA backends, registered through ``pagoda_lora_backends`` like a plugin's.

``torch``: every adapter of a pass in one shrink and one expand per segment. A pass whose tokens all use one
adapter takes two matrix products. Otherwise few adapter tokens (decodes) take the BGMV path: each token gathers
its slot's A and B and one batched matmul computes all of them; more tokens take the SGMV path: the tokens of each
adapter of the pass (at most ``max_loras`` segments) as one matrix product each. Base-model tokens are skipped.

``cpu``: ``lora_cpu.cpp``, the shrink and the expand of every adapter of a pass in one C++ call, tokens grouped
by adapter, fp32 accumulation (AVX-512, AVX2 or scalar code, built for the CPU it runs on); the default. Compiled on
first use and cached by torch's extension loader; where it cannot be built, on a GPU, or for another dtype than fp32
and bf16, the ``torch`` backend computes the terms instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from pagoda import hookimpl
from pagoda.config import LoRAConfig, ModelConfig
from pagoda.host.cpp_extension import load_cpu_extension_or_none
from pagoda.host.env import HostConfig
from pagoda.step import LoRABatch

_SOURCE = Path(__file__).with_name("lora_cpu.cpp")
KERNEL_DTYPES = (torch.float32, torch.bfloat16)

# at most this many adapter tokens gather their slot's weights each (the A and B copies cost per token)
GATHER_MAX_TOKENS = 16


class TorchLoRABackend:
    """Gather + bmm for a few tokens, index_select + matmul per adapter segment otherwise."""

    def __init__(self, lora_config: LoRAConfig, model_config: ModelConfig) -> None:
        self.gather_max_tokens = GATHER_MAX_TOKENS

    def apply(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              batch: LoRABatch) -> None:
        rows = batch.lora_rows
        num_rows = rows.numel()
        if num_rows == 0:
            return
        if num_rows == x.shape[0] and len(batch.segments) == 1:  # every token of one adapter: no gather
            slot = batch.segments[0][0]
            y.addmm_(x @ lora_a[slot].T, lora_b[slot].T)  # [n, R] @ [R, out]
            return
        if num_rows <= self.gather_max_tokens:
            xs = x.index_select(0, rows)  # [n, in]
            shrunk = torch.bmm(lora_a[batch.lora_row_slots], xs.unsqueeze(2))  # [n, R, 1]
            y.index_add_(0, rows, torch.bmm(lora_b[batch.lora_row_slots], shrunk).squeeze(2))  # [n, out]
            return
        for slot, seg_rows in batch.segments:
            xs = x.index_select(0, seg_rows)  # [n_s, in]
            y.index_add_(0, seg_rows, (xs @ lora_a[slot].T) @ lora_b[slot].T)  # [n_s, R] -> [n_s, out]


def lora_kernels_or_none(host: Optional[HostConfig] = None) -> Optional[Any]:
    """The compiled LoRA kernel (once per machine and ISA level) as an engine's host settings build it (None: the
    environment's), or None (with one warning) when it cannot be built here."""
    return load_cpu_extension_or_none("pagoda_lora_cpu", _SOURCE, fallback="the torch LoRA backend", host=host)


def lora_isa_path(backend: str, host: Optional[HostConfig] = None) -> str:
    """What computes the LoRA terms under the backend named ``backend``: ``cpu avx2`` (the kernel's ISA path), ``cpu
    torch`` where the kernel cannot be built, or the backend's name."""
    if backend != "cpu":
        return backend
    kernels = lora_kernels_or_none(host)
    return f"cpu {'torch' if kernels is None else kernels.isa_path()}"


class CpuLoRABackend:
    """The C++ kernel: one call per layer computes every adapter's shrink and expand (the ``torch`` backend where
    the kernel cannot be built, off the CPU, or for a dtype other than fp32 and bf16)."""

    def __init__(self, lora_config: LoRAConfig, model_config: ModelConfig) -> None:
        self.kernels = lora_kernels_or_none(model_config.host)
        self.fallback = TorchLoRABackend(lora_config, model_config)

    def apply(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              batch: LoRABatch) -> None:
        if batch.lora_rows.numel() == 0:
            return
        if (self.kernels is None or not x.is_cpu or x.dtype not in KERNEL_DTYPES or x.stride(-1) != 1
                or y.stride(-1) != 1):
            self.fallback.apply(y, x, lora_a, lora_b, batch)
            return
        self.kernels.lora_apply(y, x, lora_a, lora_b, batch.lora_rows, batch.lora_row_slots)


def _triton_backend(lora_config: LoRAConfig, model_config: ModelConfig):
    from pagoda.execution.lora_triton import TritonLoRABackend  # imports triton only when chosen

    return TritonLoRABackend(lora_config, model_config)


@hookimpl
def pagoda_lora_backends():
    return {"torch": TorchLoRABackend, "cpu": CpuLoRABackend, "triton": _triton_backend}
