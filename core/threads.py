"""How many CPU threads compute runs on."""

from __future__ import annotations

import os
from typing import Optional

import torch

# Measured on the 2-core machines pagoda is developed on (see README, "CPU threads"):
# the default is the core count; PAGODA_CPU_THREADS or --cpu-threads override it.
def default_num_threads() -> int:
    env = os.environ.get("PAGODA_CPU_THREADS")
    if env:
        return max(1, int(env))
    return max(1, len(os.sched_getaffinity(0)))


def configure_threads(requested: Optional[int]) -> int:
    """Set torch's intra-op threads; returns the number in use."""
    n = requested or default_num_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
