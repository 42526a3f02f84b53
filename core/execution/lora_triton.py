"""The ``triton`` LoRA backend: the shrink and the expand of a pass as one Triton kernel launch each.

One program per (adapter token, block of output rows), Punica's BGMV: the program reads its token's slot and
computes its block of ``t = lora_a[slot] @ x[row]`` (fp32) or adds its block of ``lora_b[slot] @ t`` into
``y[row]`` (fp32 sums, rounded once into ``y``). Base-model tokens get no program. Runs on a CUDA device, or on
the CPU under ``TRITON_INTERPRET=1`` (slow: that is how the kernels are checked without a GPU).
"""

from __future__ import annotations

import os

import torch

from pagoda.config import LoRAConfig, ModelConfig
from pagoda.errors import BackendUnavailable
from pagoda.step import LoRABatch

BLOCK_ROWS = 16  # output rows per program
BLOCK_K = 64  # input columns per step of a program's loop


def interpreting() -> bool:
    """True when Triton kernels defined from now on run in its interpreter (on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class TritonLoRABackend:
    """BGMV shrink and expand kernels; one launch each per layer."""

    def __init__(self, lora_config: LoRAConfig, model_config: ModelConfig) -> None:
        if not torch.cuda.is_available() and not interpreting():
            raise BackendUnavailable(
                "the triton LoRA backend needs a CUDA GPU (torch.cuda.is_available() is False here); use "
                "--lora-backend cpu or torch, or set TRITON_INTERPRET=1 before starting pagoda to run its kernels "
                "in the (slow) interpreter on the CPU")
        from pagoda.execution import lora_triton_kernels as triton_kernels

        self.kernels = triton_kernels.defined_in_this_mode()

    def apply(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              batch: LoRABatch) -> None:
        rows, slots = batch.lora_rows, batch.lora_row_slots
        n = rows.numel()
        if n == 0:
            return
        rank, in_features = lora_a.shape[1], lora_a.shape[2]
        out_features = lora_b.shape[1]
        t = torch.empty(n, rank, dtype=torch.float32, device=x.device)  # [n, R]
        grid_shrink = (n, triton_cdiv(rank, BLOCK_ROWS))
        self.kernels.shrink_kernel[grid_shrink](
            x, lora_a, t, rows, slots, in_features, rank, x.stride(0), BLOCK_R=BLOCK_ROWS, BLOCK_K=BLOCK_K)
        grid_expand = (n, triton_cdiv(out_features, BLOCK_ROWS))
        self.kernels.expand_kernel[grid_expand](
            t, lora_b, y, rows, slots, rank, out_features, y.stride(0), BLOCK_N=BLOCK_ROWS,
            BLOCK_R=max(16, 1 << (rank - 1).bit_length()))


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
