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


_PF_KTHREAD = 0x00200000  # /proc/<pid>/stat flags bit of a kernel thread


def _runnable_user_tasks(own_pid: int, proc: str = "/proc") -> int:
    """Tasks in state R that are not kernel threads and not this process's, from ``/proc/*/task/*/stat``."""
    count = 0
    for pid in os.listdir(proc):
        if not pid.isdigit() or int(pid) == own_pid:
            continue
        try:
            tids = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue  # gone
        for tid in tids:
            try:
                with open(f"{proc}/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] == "R" and not int(fields[6]) & _PF_KTHREAD:
                count += 1
    return count


def runnable_processes(samples: int = 15, interval: float = 0.004) -> float:
    """Median number of runnable user tasks besides this process's; 0 where ``/proc`` is unreadable.

    Kernel threads do not count: a memory-monitoring kernel thread (``kdamond``) that woke now and then
    on this kind of VM made start-up choose sleeping threads on an idle machine, and W1 took 16.2 s
    instead of about 12.
    """
    if not os.path.isdir("/proc/self/task"):
        return 0.0
    own = os.getpid()
    counts = []
    for _ in range(samples):
        counts.append(_runnable_user_tasks(own))
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
