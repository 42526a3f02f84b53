"""How OpenMP worker threads wait between parallel regions, decided before torch loads.

A decode step runs hundreds of short parallel regions. Threads that sleep
between them pay a futex wake-up for each one (at batch 1 on this model, 27 ms
per token against 18 ms with briefly spinning threads on an idle 2-core
machine). On a machine where other processes are runnable, spinning threads
take the cores the others need and wait on descheduled peers (the same run:
45-105 ms per token spinning against 30-44 ms sleeping). So pagoda looks at the
run queue at start-up: idle, threads spin for a bounded time before sleeping;
busy, they sleep at once. ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set by the
user are left as they are.
"""

from __future__ import annotations

import os
import statistics
import time

SPIN_COUNT = "20000"  # libgomp spin iterations before a waiting thread sleeps (well under a millisecond)

# what was decided, for the benchmarks' header
wait_policy = "user"
# the environment variables pagoda set itself (a baseline run in a child process drops them)
set_here: list[str] = []


def runnable_processes(samples: int = 15, interval: float = 0.004) -> float:
    """Median number of runnable tasks besides this one, from ``/proc/loadavg``; 0 where unreadable."""
    counts = []
    for _ in range(samples):
        try:
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)  # minus the reader itself
        except (OSError, ValueError, IndexError):
            return 0.0
        time.sleep(interval)
    return statistics.median(counts)


def choose_wait_policy() -> str:
    """Set the OpenMP wait policy in the environment (torch must not be loaded yet). Returns it."""
    global wait_policy
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        wait_policy = "user"
    elif runnable_processes() >= 1:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        set_here.append("OMP_WAIT_POLICY")
        wait_policy = "sleep (other processes were runnable at start-up)"
    else:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        set_here.append("GOMP_SPINCOUNT")
        wait_policy = f"spin {SPIN_COUNT}, then sleep (the machine was idle at start-up)"
    return wait_policy
