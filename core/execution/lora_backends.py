"""The built-in LoRA backend, ``torch``: every adapter of a pass in one shrink and one expand per segment.

Registered through ``pagoda_lora_backends`` like a plugin's. A pass whose tokens all use one adapter takes two
matrix products. Otherwise few adapter tokens (decodes) take the BGMV path: each token gathers its slot's A and
B and one batched matmul computes all of them; more tokens take the SGMV path: the tokens of each adapter of
the pass (at most ``max_loras`` segments) as one matrix product each. Base-model tokens are skipped.
"""

from __future__ import annotations

import torch

from pagoda.config import LoRAConfig, ModelConfig
from pagoda.markers import hookimpl
from pagoda.step import LoRABatch

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


@hookimpl
def pagoda_lora_backends():
    return {"torch": TorchLoRABackend}
