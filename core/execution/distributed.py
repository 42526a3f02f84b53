"""Tensor parallelism: which part of each weight this rank holds, and the collectives that join the parts.

One process per rank, all running the same model code on their shards (SPMD). A process that runs a
model alone has rank 0 of 1, every partition is the whole, and no collective is called. The partitions
need not be even: the default model's 9 query heads over 2 ranks are 6 and 3, following its 3 KV heads,
and with more ranks than KV heads each KV head is held by several ranks (replicated), each taking part of
its query heads.
"""

from __future__ import annotations

import datetime
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from pagoda.errors import ConfigError
from pagoda.execution.pipeline import PipelineStage, stage_of

if TYPE_CHECKING:
    from pagoda.config import EngineConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place: ``rank`` of ``size``; ``group`` is the torch.distributed group (None alone);
    ``comm`` the all-reduce backend that joins the ranks (a :class:`pagoda.interfaces.AllReduce`, None alone)
    and ``comm_name`` its name."""

    rank: int = 0
    size: int = 1
    group: Optional[object] = None
    comm: Optional[Any] = None
    comm_name: str = ""

    def all_reduce(self, x: torch.Tensor, where: str = "linear") -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            start = time.perf_counter()
            self.comm.all_reduce(x)
            _record(where, start)
        return x

    def all_gather_last(self, x: torch.Tensor, sizes: list[int], where: str = "logits") -> torch.Tensor:
        """Concatenate every rank's ``x [..., sizes[rank]]`` along the last axis (uneven sizes allowed)."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        width = max(sizes)
        padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()  # [..., width] on every rank
        parts = self.comm.all_gather(padded)
        gathered = torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)
        _record(where, start)
        return gathered


# calls and seconds of the collectives this process ran, by where in the model (``--profile`` reads them)
collective_stats: dict[str, list] = defaultdict(lambda: [0, 0.0])


def _record(where: str, start: float) -> None:
    entry = collective_stats[where]
    entry[0] += 1
    entry[1] += time.perf_counter() - start


_current = TensorParallel()
_stage = PipelineStage()


def current() -> TensorParallel:
    """The tensor-parallel place of the model being built or run in this process."""
    return _current


def current_stage() -> PipelineStage:
    """The pipeline stage of the model being built or run in this process (stage 0 of 1 alone)."""
    return _stage


def init(rank: int, size: int, address: str, timeout_seconds: float = 600.0,
         engine_config: Optional["EngineConfig"] = None, plugin_manager: Any = None) -> TensorParallel:
    """Join the ``size`` processes at ``address`` (``tcp://host:port``) as ``rank`` over torch.distributed
    (gloo on CPUs, NCCL on GPUs), build the all-reduce backend ``engine_config`` selects (torch.distributed's
    own without one), and make this the place models are built for.

    With pipeline parallelism (``engine_config.parallel.pipeline_parallel_size`` > 1) the ``size`` ranks are
    stages of ``tensor_parallel_size`` ranks each (:mod:`pagoda.execution.pipeline`); each stage's ranks get a
    process group of their own for their collectives."""
    global _current, _stage
    from pagoda.execution.collectives import TorchAllReduce, build_all_reduce

    if torch.distributed.is_initialized():
        raise ConfigError("this process already runs a tensor-parallel engine; shut it down first "
                          "(engine.shutdown()) or start the next one in another process")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend, init_method=address, rank=rank, world_size=size,
                                         timeout=datetime.timedelta(seconds=timeout_seconds))
    group, tp_rank, tp_size = torch.distributed.group.WORLD, rank, size
    try:
        if engine_config is not None and engine_config.parallel.pipeline_parallel_size > 1:
            tp_size = engine_config.parallel.tensor_parallel_size
            tp_rank = rank % tp_size
            # every rank creates every stage's group, in the same order (torch.distributed requires it)
            groups = [torch.distributed.new_group(list(range(s * tp_size, (s + 1) * tp_size)))
                      for s in range(size // tp_size)]
            group = groups[rank // tp_size]
            _stage = stage_of(rank, tp_size, engine_config.parallel.pipeline_layer_partition)
        if tp_size == 1:  # one rank per stage: no collective to join
            name, comm = "", None
        elif engine_config is None:
            name, comm = "gloo", TorchAllReduce(engine_config, tp_rank, tp_size, group, timeout_seconds)
        else:
            name, comm = build_all_reduce(engine_config, plugin_manager, tp_rank, tp_size, group, timeout_seconds)
    except BaseException:
        _stage = PipelineStage()
        torch.distributed.destroy_process_group()
        raise
    _current = TensorParallel(tp_rank, tp_size, group, comm, name)
    return _current


def shutdown() -> None:
    """Close the all-reduce backend and leave the process group."""
    global _current, _stage
    if _current.comm is not None:
        _current.comm.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _current = TensorParallel()
    _stage = PipelineStage()


def split(total: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, size)`` of part ``index`` of ``total`` items in ``parts`` contiguous parts, sizes differing by
    at most one."""
    start, end = total * index // parts, total * (index + 1) // parts
    return start, end - start


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: query heads ``[q_start, q_start + num_heads)`` and KV heads
    ``[kv_start, kv_start + num_kv_heads)``."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_shard(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadShard:
    """Each rank keeps whole KV heads with the query heads that read them; with more ranks than KV heads,
    the ranks sharing a KV head split its query heads."""
    if tp.size == 1:
        return HeadShard(0, num_heads, 0, num_kv_heads)
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp.size:
        kv_start, kv_count = split(num_kv_heads, tp.size, tp.rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if tp.size % num_kv_heads:
        raise ConfigError(f"tensor_parallel_size={tp.size} is more than the model's {num_kv_heads} KV heads and not "
                          f"a multiple of them; use a size that divides {num_kv_heads} or a multiple of it")
    sharing = tp.size // num_kv_heads  # ranks per KV head
    if group < sharing:
        raise ConfigError(f"tensor_parallel_size={tp.size} gives each of the {num_kv_heads} KV heads {sharing} "
                          f"ranks but it has only {group} query heads; use at most {num_heads} ranks")
    kv = tp.rank // sharing
    q_start, q_count = split(group, sharing, tp.rank % sharing)
    return HeadShard(kv * group + q_start, q_count, kv, 1)
