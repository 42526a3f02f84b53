"""The vocabulary-parallel embedding and LM head: each tensor-parallel rank holds a contiguous range of the
vocabulary's rows; alone, all of them."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagoda.errors import CheckpointError
from pagoda.execution import distributed
from pagoda.modeling.layers import onednn
from pagoda.modeling.layers.fused_ops import CpuKernels
from pagoda.modeling.layers.linear import Linear


class VocabParallelEmbedding(nn.Module):
    """Token embedding over this rank's vocabulary rows: each rank looks the ids up in its rows (zeros for the
    others), and the sum over the ranks is the embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp = distributed.current()
        self.vocab_size = vocab_size
        self.vocab_start, rows = distributed.split(vocab_size, tp.size, tp.rank)
        self.num_embeddings = rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype), requires_grad=False)
        if tp.size > 1:
            self.weight.weight_loader = self._load_rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        x = nn.functional.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(x, "embedding")

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard: Optional[int], name: str) -> None:
        rows = loaded.narrow(0, self.vocab_start, param.shape[0])
        if tuple(rows.shape) != tuple(param.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(loaded.shape)}; the model expects "
                                  f"{self.vocab_size} rows of {param.shape[1]}")
        param.data.copy_(rows.to(param.dtype))


class ParallelLMHead(Linear):
    """The untied LM head: this rank's vocabulary rows of ``lm_head.weight`` (all of them alone)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, kernels: CpuKernels,
                 prefix: str = "lm_head") -> None:
        tp = distributed.current()
        start, rows = distributed.split(vocab_size, tp.size, tp.rank)
        super().__init__(hidden_size, [vocab_size], False, dtype, None, prefix,
                         tp_rows=[(start, rows)] if tp.size > 1 else None, kernels=kernels)


class Logits:
    """``hidden -> logits [n, vocab]`` in float32 over the whole vocabulary: an untied head, or the embedding's
    weight (tied), packed once for the CPU matmul (see ``layers.onednn``) while the embedding itself stays plain
    for the token lookup; under tensor parallelism each rank's rows, gathered."""

    def __init__(self, vocab_size: int, kernels: CpuKernels) -> None:
        self.tp = tp = distributed.current()
        self.kernels = kernels
        self.vocab_parts = [distributed.split(vocab_size, tp.size, r)[1] for r in range(tp.size)]
        self._packed_key = None
        self._packed = None

    def __call__(self, hidden: torch.Tensor, lm_head: Optional[Linear], embedding: Optional[nn.Module]
                 ) -> torch.Tensor:
        if lm_head is not None:
            logits = lm_head(hidden).float()
        else:
            head = self.packed_tied(embedding)
            if head is not None:
                logits = onednn.packed_linear(hidden, head).float()
            else:
                logits = self.kernels.linear(hidden, embedding.weight).float()
        return logits if self.tp.size == 1 else self.tp.all_gather_last(logits, self.vocab_parts)

    def packed_tied(self, embedding: nn.Module) -> Optional[torch.Tensor]:
        """The embedding packed for the LM head, made on first use and again whenever the embedding changes;
        None where packing does not apply."""
        w = embedding.weight
        key = (w.data_ptr(), w.dtype, None if w.is_inference() else w._version)
        if self._packed_key != key:
            self._packed = self.kernels.pack_weight(w.data)
            self._packed_key = key
        return self._packed
