"""The all-reduce backends (``pagoda_all_reduce_backends``): how the ranks of a tensor-parallel model sum
their partial results and gather their vocabulary shards.

- ``gloo``: torch.distributed's collectives on the ranks' process group (gloo on CPUs, NCCL on GPUs).
- ``shm``: a shared-memory file every rank maps (ranks on one host, CPU tensors); see
  :mod:`pagoda.execution.shm_all_reduce`.
- ``auto`` (the default): ``shm`` when the tensors are on CPU and every rank can map the same file (they are
  on this host), else ``gloo``.
"""

from __future__ import annotations

import logging
import platform
from typing import Any

import torch

from pagoda import hookimpl
from pagoda.config import EngineConfig
from pagoda.errors import BackendUnavailable, ConfigError

logger = logging.getLogger("pagoda")


class TorchAllReduce:
    """torch.distributed's all-reduce and all-gather on the ranks' process group."""

    def __init__(self, engine_config: EngineConfig, rank: int, size: int, group: Any,
                 timeout_seconds: float) -> None:
        self.size, self.group = size, group

    def all_reduce(self, x: torch.Tensor) -> None:
        torch.distributed.all_reduce(x, group=self.group)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def close(self) -> None:
        pass


def shm_all_reduce(engine_config: EngineConfig, rank: int, size: int, group: Any, timeout_seconds: float):
    """The ``shm`` backend, one slot per rank sized for the largest hidden-state all-reduce of a step:
    ``hidden_size x max_num_batched_tokens`` float32 values (larger tensors, such as the logits gather, go
    in several rounds)."""
    from pagoda.execution.shm_all_reduce import ShmAllReduce

    if engine_config.device != "cpu":
        raise BackendUnavailable(f"all_reduce_backend 'shm' sums CPU tensors; the model runs on "
                                 f"{engine_config.device}: pass --all-reduce-backend gloo (or auto)")
    if not _is_x86():  # its flags rely on x86's store ordering (pagoda.execution.shm_all_reduce)
        raise BackendUnavailable(f"all_reduce_backend 'shm' needs an x86-64 CPU (this one is "
                                 f"{platform.machine()}): pass --all-reduce-backend gloo (or auto)")
    slot_bytes = engine_config.model.hidden_size * engine_config.scheduler.max_num_batched_tokens * 4
    return ShmAllReduce(rank, size, group, timeout_seconds, slot_bytes)


def all_reduce_candidates(engine_config: EngineConfig) -> list[str]:
    """The backends to try in order: the configured one, or for ``auto`` ``shm`` then ``gloo`` on x86-64 CPUs
    (where plain stores are seen in order by the other ranks; see :mod:`pagoda.execution.shm_all_reduce`)."""
    name = engine_config.parallel.all_reduce_backend
    if name != "auto":
        return [name]
    return ["shm", "gloo"] if engine_config.device == "cpu" and _is_x86() else ["gloo"]


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def build_all_reduce(engine_config: EngineConfig, plugin_manager: Any, rank: int, size: int, group: Any,
                     timeout_seconds: float) -> tuple[str, Any]:
    """``(name, backend)`` for this rank: the first candidate that builds. Every rank reaches the same
    answer (a backend that cannot run raises BackendUnavailable on every rank alike)."""
    candidates = all_reduce_candidates(engine_config)
    for i, name in enumerate(candidates):
        factory = plugin_manager.get("pagoda_all_reduce_backends", name, "all_reduce_backend").factory
        try:
            return name, factory(engine_config, rank, size, group, timeout_seconds)
        except BackendUnavailable as exc:
            if i + 1 == len(candidates):
                raise ConfigError(f"all_reduce_backend {name!r} cannot run here: {exc}") from None
            logger.info("all-reduce backend %s cannot run here (%s); trying %s", name, exc, candidates[i + 1])
    raise AssertionError("unreachable: candidates is never empty")


@hookimpl
def pagoda_all_reduce_backends():
    return {"gloo": TorchAllReduce, "shm": shm_all_reduce}
