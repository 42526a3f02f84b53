"""Pipeline parallelism: which decoder layers this process's stage holds, and the hand-off between stages.

A model of ``num_stages`` stages runs on ``tensor_parallel_size x num_stages`` ranks. Rank ``r`` is stage
``r // tensor_parallel_size`` and tensor-parallel index ``r % tensor_parallel_size``: the driver (rank 0) is
stage 0's first tensor-parallel rank, and the ranks of one stage are consecutive (they share a host, so their
per-layer all-reduce stays on it). Stage ``s`` holds the contiguous layers ``[layer_start, layer_end)``; the
first stage also holds the embedding, the last the final norm and the LM head (and the embedding too when the
LM head is tied to it). Between stages, each tensor-parallel rank sends its hidden states and residual (the
same on every rank of a stage, after the all-reduce) to the rank of the same index in the next stage, with
torch.distributed point-to-point (gloo on CPUs, NCCL on GPUs). A process that runs a model alone is stage 0 of
1 and holds every layer.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagoda.errors import ConfigError


@dataclass(frozen=True)
class PipelineStage:
    """This process's stage: ``stage`` of ``num_stages``, holding layers ``[layer_start, layer_end)``;
    ``prev_rank`` / ``next_rank``: the global ranks it receives from and sends to (None at the ends)."""

    stage: int = 0
    num_stages: int = 1
    layer_start: int = 0
    layer_end: Optional[int] = None  # None: every layer (a model alone)
    prev_rank: Optional[int] = None
    next_rank: Optional[int] = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def owns_layer(self, index: int) -> bool:
        return self.layer_start <= index and (self.layer_end is None or index < self.layer_end)

    def num_layers(self, total: int) -> int:
        """Decoder layers this stage holds, of a model of ``total``."""
        return (total if self.layer_end is None else self.layer_end) - self.layer_start

    def receive(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's hidden states and residual, each ``[num_tokens, hidden_size]``."""
        start = time.perf_counter()
        both = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
        torch.distributed.recv(both, src=self.prev_rank)
        _record("receive", start)
        return both[0], both[1]

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Hand ``hidden`` and ``residual`` (``[num_tokens, hidden_size]`` each) to the next stage."""
        start = time.perf_counter()
        torch.distributed.send(torch.stack((hidden, residual)).contiguous(), dst=self.next_rank)
        _record("send", start)


# calls and seconds of this process's stage work: "execute" (its runner's whole step, hand-offs included),
# "send" and "receive" (the hand-offs; a receive includes the wait for the previous stage); ``--profile`` reads
# every rank's through the executor's ``stage_stats``
handoff_stats: dict[str, list] = defaultdict(lambda: [0, 0.0])


def _record(kind: str, start: float) -> None:
    entry = handoff_stats[kind]
    entry[0] += 1
    entry[1] += time.perf_counter() - start


def timed_execute(runner: Any, sched: Any) -> Any:
    """``runner.execute(sched)``, its seconds added to this process's "execute" entry."""
    start = time.perf_counter()
    try:
        return runner.execute(sched)
    finally:
        _record("execute", start)


def stats_snapshot() -> dict[str, tuple[int, float]]:
    """This process's stage work so far (see ``handoff_stats``)."""
    return {kind: (n, seconds) for kind, (n, seconds) in handoff_stats.items()}


def layer_partition(num_layers: int, num_stages: int, explicit: Optional[list[int]] = None) -> tuple[int, ...]:
    """Layers per stage: ``explicit`` checked against the model, else an even split (the earlier stages one
    layer more when the count does not divide)."""
    if num_stages > num_layers:
        raise ConfigError(f"pipeline_parallel_size={num_stages} is more than the model's {num_layers} decoder "
                          f"layers; every stage needs at least one: pass --pipeline-parallel-size <= {num_layers}")
    if explicit is None:
        base, extra = divmod(num_layers, num_stages)
        return tuple(base + (1 if s < extra else 0) for s in range(num_stages))
    if len(explicit) != num_stages:
        raise ConfigError(f"pipeline_layer_partition {_text(explicit)} has {len(explicit)} stage(s) but "
                          f"pipeline_parallel_size is {num_stages}; give one layer count per stage")
    if any(n < 1 for n in explicit):
        raise ConfigError(f"pipeline_layer_partition {_text(explicit)} gives a stage no layer; every stage needs "
                          "at least one")
    if sum(explicit) != num_layers:
        raise ConfigError(f"pipeline_layer_partition {_text(explicit)} sums to {sum(explicit)} layers but the model "
                          f"has {num_layers}; give counts that sum to {num_layers}")
    return tuple(explicit)


def parse_partition(text: str) -> list[int]:
    """``"12,18"`` -> ``[12, 18]``; anything else is refused saying how to write it."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"pipeline_layer_partition {text!r} is not comma-separated layer counts, one per "
                          "stage (e.g. 12,18)") from None


def stage_of(rank: int, tensor_parallel_size: int, partition: tuple[int, ...]) -> PipelineStage:
    """The stage of global ``rank`` (see the module docstring for the layout)."""
    stage, num_stages = rank // tensor_parallel_size, len(partition)
    start = sum(partition[:stage])
    return PipelineStage(stage, num_stages, start, start + partition[stage],
                         rank - tensor_parallel_size if stage > 0 else None,
                         rank + tensor_parallel_size if stage < num_stages - 1 else None)


def _text(counts: list[int]) -> str:
    return ",".join(str(n) for n in counts)
