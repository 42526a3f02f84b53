"""How many CPU threads compute runs on: a setting, defaulting to a measurement taken at start-up."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)


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


def measure_best_threads(rounds: int = 3, repeats: int = 12, margin: float = 0.9) -> int:
    """Try one thread and every core, ``rounds`` times each, interleaved; one thread only when it is clearly
    faster (its best time under ``margin`` times every core's best).

    On a shared machine, threads that wait for each other can be many times
    slower than one thread alone; on a quiet one, more threads win. A near tie
    is noise (a kernel thread woke on the other core for a moment), and on a
    quiet machine every core is the better bet: one start-up check on this kind
    of machine once gave 1.26 ms for one thread against 1.25 ms for two, where
    two usually take 0.8 ms.
    """
    cores = available_cores()
    if cores == 1:
        return 1
    timings = {1: [], cores: []}
    for _ in range(rounds):
        for n in timings:
            timings[n].append(_time_matmuls(n, repeats))
    return 1 if min(timings[1]) < margin * min(timings[cores]) else cores


def configure_threads(requested: Optional[int]) -> int:
    """Set torch's intra-op threads: ``requested`` (the resolved ``cpu_threads`` option), else measured.
    Returns it."""
    n = requested or measure_best_threads()
    torch.set_num_threads(n)
    return n


class ThreadGovernor:
    """Re-takes the start-up measurement now and then, so a machine that gets busy (or quiet) mid-run
    is followed: two threads that wait on each other under load can be several times slower than one.

    Only for a measured thread count (no ``--cpu-threads`` / ``PAGODA_CPU_THREADS``) on more than one
    core. A check costs about 25 ms of matmuls; at most one every ``interval`` seconds (the
    ``thread_recheck_seconds`` option). W1 with one
    busy process arriving once it had started (threads spinning, as chosen on the idle machine):
    44.3 and 43.5 s without re-checks, 25.1 and 26.7 s re-checking every 5 s and switching on one
    check. A switch now waits for two checks in a row: one noisy check on a quiet machine once
    dropped a benchmark to one thread.
    """

    def __init__(self, threads: int, interval: float = 5.0, measure: Optional[Callable[[], int]] = None) -> None:
        self.threads = threads
        self.interval = interval
        self._measure = measure or (lambda: measure_best_threads(rounds=1, repeats=4))
        self._next = time.monotonic() + interval
        self._pending: Optional[int] = None  # a different count seen at the last check, not yet taken

    @classmethod
    def for_setting(cls, requested: Optional[int], threads: int,
                    interval: float = 5.0) -> Optional["ThreadGovernor"]:
        """A governor when the count was measured (``requested`` is None) and re-checks are on (``interval``
        above 0), else None (the user's setting, or the start-up measurement, stays)."""
        if requested or available_cores() == 1 or interval <= 0:
            return None
        return cls(threads, interval)

    def maybe_retune(self) -> int:
        """Measure again if the interval has passed; returns the thread count now in use."""
        now = time.monotonic()
        if now < self._next:
            return self.threads
        best = self._measure()
        # one measurement can be a hiccup: change only when two checks in a row agree on it
        if best != self.threads and best == self._pending:
            logger.info("compute threads %d -> %d (re-measured: the machine's load changed)", self.threads, best)
            self.threads = best
        self._pending = best if best != self.threads else None
        torch.set_num_threads(self.threads)  # the measurement itself changed it
        self._next = time.monotonic() + self.interval
        return self.threads
