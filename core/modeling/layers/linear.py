"""Linear layers that ask a quant method to create, load, post-process and apply their weights, and the
vocabulary-parallel embedding and LM head: each tensor-parallel rank holds a contiguous range of the
vocabulary's rows; alone, all of them."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from pagoda.errors import CheckpointError
from pagoda.execution import distributed
from pagoda.modeling.layers.fused_ops import CpuKernels


# the fused layers of the model being built and the checkpoint modules each stacks, in shard order: its
# architecture's ``packed_modules_mapping``, which quant configs read to match their per-module entries
_PACKED_MODULES: contextvars.ContextVar[Mapping[str, Sequence[str]]] = contextvars.ContextVar(
    "pagoda_packed_modules", default={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")})


@contextlib.contextmanager
def packed_modules(mapping: Mapping[str, Sequence[str]]) -> Iterator[None]:
    """Within the block, :func:`current_packed_modules` is ``mapping`` (a model sets it while building its layers)."""
    token = _PACKED_MODULES.set(mapping)
    try:
        yield
    finally:
        _PACKED_MODULES.reset(token)


def current_packed_modules() -> Mapping[str, Sequence[str]]:
    """The fused layers of the model being built (Llama's qkv_proj and gate_up_proj outside a build)."""
    return _PACKED_MODULES.get()


class UnquantizedLinearMethod:
    """Plain dense weights: ``weight [out_features, in_features]`` in the model dtype.

    Once loaded, a bf16 weight on a CPU is replaced by its packed form where the model's kernels pack: oneDNN's
    (see ``layers.onednn``: same shape and values, an opaque layout, ``onednn.dense(layer.weight)`` gives the plain
    matrix back), or the packed GEMM's (``[out, ceil(in / 2), 2]``; see ``CpuKernels.pack_weight``): always in the
    batch-invariant mode, and in the default mode where the ``cpu_linear_kernel`` host setting picks it. ``kernels``: the model's CPU kernels, which say whether and how it packs, and
    multiply (None: torch ops).
    """

    def __init__(self, kernels: Optional[CpuKernels] = None) -> None:
        self.kernels = kernels or CpuKernels()

    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype), requires_grad=False)
        weight.weight_loader = layer.load_sharded
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        if layer.packed:
            return
        packed = self.kernels.pack_weight(layer.weight.data)
        if packed is not None:  # the plain copy is dropped: one copy of the weights in memory
            layer.weight = nn.Parameter(packed, requires_grad=False)
            layer.packed = True

    def apply(self, layer: "Linear", x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if layer.packed:  # Linear.forward takes this path itself; here for callers of apply
            return self.kernels.packed_linear(x, layer.weight, bias)
        return self.kernels.linear(x, layer.weight, bias)


class Linear(nn.Module):
    """``y = x W^T + b`` whose output may be several checkpoint tensors stacked (fused QKV, gate/up).

    ``output_sizes`` lists the stacked shards in order; a checkpoint tensor
    for shard ``i`` is loaded into rows ``sum(output_sizes[:i])`` onward.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        quant_method=None,
        prefix: str = "",
        tp_rows: Optional[Sequence[tuple[int, int]]] = None,
        tp_cols: Optional[tuple[int, int]] = None,
        kernels: Optional[CpuKernels] = None,
    ) -> None:
        """``tp_rows`` (column parallelism): per output shard, the ``(start, size)`` rows this rank holds;
        ``tp_cols`` (row parallelism): the ``(start, size)`` input columns it holds, its partial outputs
        summed over the ranks (see :mod:`pagoda.execution.distributed`). ``kernels``: the model's CPU kernels,
        for unquantized weights (None: torch ops)."""
        super().__init__()
        # the checkpoint's sizes, before this rank's split (quantized formats record them)
        self.full_in_features, self.full_output_sizes = in_features, list(output_sizes)
        self.tp_rows = list(tp_rows) if tp_rows is not None else None
        self.tp_cols = tp_cols
        self.tp = distributed.current() if tp_cols is not None else None
        self.in_features = tp_cols[1] if tp_cols is not None else in_features
        self.output_sizes = [size for _, size in self.tp_rows] if self.tp_rows is not None else list(output_sizes)
        self.out_features = sum(self.output_sizes)
        self.prefix = prefix
        # weight packed by its quant method's kernels (see UnquantizedLinearMethod): forward calls their product
        self.packed = False
        # the adapter slots of multi-LoRA serving (a pagoda.execution.lora.LoRALayer), set by the runner; None: off
        self.lora = None
        self.quant_method = quant_method or UnquantizedLinearMethod(kernels)
        self.quant_method.create_weights(self, dtype)
        if bias:
            b = nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False)
            b.weight_loader = self.load_sharded
            self.bias = b
        else:
            self.bias = None

    def shard_offset(self, shard_id: int) -> tuple[int, int]:
        start = sum(self.output_sizes[:shard_id])
        return start, self.output_sizes[shard_id]

    def load_sharded(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int], name: str) -> None:
        """Copy a checkpoint tensor into ``param`` (dim 0 holds the stacked output shards); under tensor
        parallelism, only this rank's rows or columns of it."""
        if self.tp_rows is not None:
            loaded = loaded.narrow(0, *self.tp_rows[shard_id or 0])
        if self.tp_cols is not None and loaded.dim() == 2:
            loaded = loaded.narrow(1, *self.tp_cols)
        if shard_id is None:
            target = param.data
        else:
            start, size = self.shard_offset(shard_id)
            # a param whose first dim is not the output dim (packed layouts) must bring its own loader
            target = param.data.narrow(0, start, size)
        if tuple(target.shape) != tuple(loaded.shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(loaded.shape)} but the model expects {tuple(target.shape)} "
                f"for {self.prefix}; the checkpoint does not match its config.json"
            )
        target.copy_(loaded.to(target.dtype))

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:  # row parallel: partial sums over this rank's columns, the bias added once
            y = (self.quant_method.kernels.packed_linear(x, self.weight, None) if self.packed
                 else self.quant_method.apply(self, x, None))
            if self.lora is not None:  # this rank's part of the LoRA term too: the all-reduce sums the parts
                self.lora.add(x, y)
            self.tp.all_reduce(y)
            return y if self.bias is None else y + self.bias
        if self.packed:  # the hot path of a bf16 model on a CPU, 121 calls a decode step here: no detours
            y = self.quant_method.kernels.packed_linear(x, self.weight, self.bias)
        else:
            y = self.quant_method.apply(self, x, self.bias)
        return y if self.lora is None else self.lora.add(x, y)  # the adapters' terms, in place


# ---- the parallel layers: each computes its own part of the weight under tensor parallelism -----------------


class ColumnParallelLinear(Linear):
    """Output rows split over the tensor-parallel ranks: each output shard (gate, up, ...) is split evenly and
    this rank holds its part of every one. Alone, the whole layer."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool, dtype: torch.dtype,
                 quant_method=None, prefix: str = "", kernels: Optional[CpuKernels] = None) -> None:
        tp = distributed.current()
        rows = [distributed.split(size, tp.size, tp.rank) for size in output_sizes] if tp.size > 1 else None
        super().__init__(in_features, output_sizes, bias, dtype, quant_method, prefix, tp_rows=rows, kernels=kernels)


class QKVParallelLinear(Linear):
    """The fused q, k, v projection: this rank's query heads and the KV heads they read (see
    :func:`pagoda.execution.distributed.head_shard`). ``self.heads`` is the rank's shard."""

    def __init__(self, in_features: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype, quant_method=None, prefix: str = "", kernels: Optional[CpuKernels] = None) -> None:
        tp = distributed.current()
        self.heads = heads = distributed.head_shard(num_heads, num_kv_heads, tp)
        d = head_dim
        rows = [(heads.q_start * d, heads.num_heads * d)] + [(heads.kv_start * d, heads.num_kv_heads * d)] * 2
        super().__init__(in_features, [num_heads * d, num_kv_heads * d, num_kv_heads * d], bias, dtype, quant_method,
                         prefix, tp_rows=rows if tp.size > 1 else None, kernels=kernels)

    @property
    def q_cols(self) -> tuple[int, int]:
        """The input columns of the output projection that read this rank's query heads."""
        start, size = self.tp_rows[0] if self.tp_rows is not None else (0, self.full_output_sizes[0])
        return start, size


class RowParallelLinear(Linear):
    """Input columns split over the ranks, the partial outputs summed (all-reduce), the bias added once.
    ``input_part``: the ``(start, size)`` columns this rank holds (default: an even split); alone, all."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, quant_method=None,
                 prefix: str = "", kernels: Optional[CpuKernels] = None,
                 input_part: Optional[tuple[int, int]] = None) -> None:
        tp = distributed.current()
        cols = None
        if tp.size > 1:
            cols = input_part if input_part is not None else distributed.split(in_features, tp.size, tp.rank)
        super().__init__(in_features, [out_features], bias, dtype, quant_method, prefix, tp_cols=cols, kernels=kernels)

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
    weight (tied), packed once for the CPU matmul (see ``CpuKernels.pack_weight``) while the embedding itself
    stays plain for the token lookup; under tensor parallelism each rank's rows, gathered."""

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
                logits = self.kernels.packed_linear(hidden, head).float()
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
