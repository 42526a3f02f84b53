"""The built-in LoRA backend, ``torch``: every adapter of a pass in one shrink and one expand per segment.

Registered through ``pagoda_lora_backends`` like a plugin's. Few adapter tokens (decodes) take the BGMV path:
each token gathers its slot's A and B and one batched matmul computes all of them. More tokens take the SGMV
path: the tokens of each adapter of the pass (at most ``max_loras`` segments) as one matrix product. Base-model
tokens are skipped by both.
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
        if rows.numel() == 0:
            return
        if rows.numel() <= self.gather_max_tokens:
            xs = x.index_select(0, rows)  # [n, in]
            shrunk = torch.bmm(lora_a[batch.lora_row_slots], xs.unsqueeze(2))  # [n, R, 1]
            delta = torch.bmm(lora_b[batch.lora_row_slots], shrunk).squeeze(2)  # [n, out]
            y.index_add_(0, rows, delta.to(y.dtype))
            return
        for slot, seg_rows in batch.segments:
            xs = x if seg_rows.numel() == x.shape[0] else x.index_select(0, seg_rows)  # [n_s, in]
            delta = (xs @ lora_a[slot].T) @ lora_b[slot].T  # [n_s, R] -> [n_s, out]
            if seg_rows.numel() == x.shape[0]:
                y.add_(delta)
            else:
                y.index_add_(0, seg_rows, delta.to(y.dtype))


@hookimpl
def pagoda_lora_backends():
    return {"torch": TorchLoRABackend}
