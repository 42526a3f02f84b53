"""How many CPU threads compute runs on: a setting, defaulting to a measurement taken at start-up."""

from __future__ import annotations

import os
import time
from typing import Optional

import torch


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _time_matmuls(num_threads: int, repeats: int = 12) -> float:
    """Median time of a decode-shaped bf16 projection (batch 64, 576 -> 1536) on ``num_threads``."""
    torch.set_num_threads(num_threads)
    x = torch.randn(64, 576, dtype=torch.bfloat16)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)
    torch.nn.functional.linear(x, w)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(4):
            torch.nn.functional.linear(x, w)
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def measure_best_threads() -> int:
    """Try one thread and every core, twice each, interleaved; keep the faster.

    On a shared machine, threads that wait for each other can be many times
    slower than one thread alone; on a quiet one, more threads win.
    """
    cores = available_cores()
    if cores == 1:
        return 1
    timings = {1: [], cores: []}
    for _ in range(2):
        for n in timings:
            timings[n].append(_time_matmuls(n))
    return min(timings, key=lambda n: min(timings[n]))


def configure_threads(requested: Optional[int]) -> int:
    """Set torch's intra-op threads: ``requested``, else ``PAGODA_CPU_THREADS``, else measured. Returns it."""
    env = os.environ.get("PAGODA_CPU_THREADS")
    if requested:
        n = requested
    elif env:
        n = max(1, int(env))
    else:
        n = measure_best_threads()
    torch.set_num_threads(n)
    return n
