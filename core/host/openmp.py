"""How OpenMP worker threads wait between parallel regions, decided before torch loads.

A decode step runs hundreds of short parallel regions. Threads that sleep
between them pay a futex wake-up for each one (at batch 1 on this model, 27 ms
per token against 18 ms with briefly spinning threads on an idle 2-core
machine). On a machine where other processes are runnable, spinning threads
take the cores the others need and wait on descheduled peers (the same run:
45-105 ms per token spinning against 30-44 ms sleeping). So pagoda looks at the
run queue at start-up: idle, threads spin for a bounded time before sleeping;
busy, they sleep at once. The ``omp_wait_policy`` option (``--omp-wait-policy``)
can also say ``spin`` or ``sleep`` outright. ``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT`` set by the user are left as they are.

OpenMP reads these variables once, when torch loads it, so the choice is made
before torch is imported: by the ``pagoda`` command at its start, and in a
program by ``pagoda.host.settings.set_openmp_wait_policy()``. Importing pagoda does not
make it.
"""

from __future__ import annotations

import os
import statistics
import time

SPIN_COUNT = "20000"  # libgomp spin iterations before a waiting thread sleeps (well under a millisecond)
WAIT_POLICIES = ("auto", "spin", "sleep")

# what was decided, in words, for the benchmarks' header
wait_policy = "OpenMP's default (pagoda did not choose one before torch loaded)"
# the policy asked for when the choice was made (None: it was not made in this process)
requested_policy: str | None = None
# the environment variables pagoda set itself, with their values (a baseline run in a child process drops them)
set_here: dict[str, str] = {}
_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


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


def is_set_by_user() -> bool:
    """True when ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` holds a value pagoda did not put there."""
    return any(name in os.environ and os.environ[name] != set_here.get(name) for name in _VARIABLES)


def choose_wait_policy(policy: str = "auto") -> str:
    """Set the OpenMP wait policy in the environment (torch must not be loaded yet). Returns it, in words.

    ``spin``: threads spin briefly, then sleep; ``sleep``: they sleep at once; ``auto``: spin on an
    idle machine, sleep when other processes are runnable. The user's own OpenMP variables win.
    """
    global wait_policy, requested_policy
    if policy not in WAIT_POLICIES:
        raise ValueError(f"omp_wait_policy {policy!r} is not one of {', '.join(WAIT_POLICIES)}")
    requested_policy = policy
    if is_set_by_user():
        wait_policy = "user"
        return wait_policy
    for name in set_here:  # a choice made earlier in this process is made again
        os.environ.pop(name, None)
    set_here.clear()
    if policy == "auto":
        busy = runnable_processes() >= 1
        reason = "other processes were runnable at start-up" if busy else "the machine was idle at start-up"
    else:
        busy = policy == "sleep"
        reason = f"omp_wait_policy {policy}"
    name, value = ("OMP_WAIT_POLICY", "PASSIVE") if busy else ("GOMP_SPINCOUNT", SPIN_COUNT)
    os.environ[name] = set_here[name] = value
    wait_policy = f"sleep ({reason})" if busy else f"spin {SPIN_COUNT}, then sleep ({reason})"
    return wait_policy


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads, and run its later parallel regions on itself alone.

    libgomp keeps a pool of workers for each thread that ran a parallel region, and once it manages more threads
    than the process has CPUs it stops its workers' spinning between regions (some 100 iterations): each region
    then wakes its workers through a futex. A server builds its engine in one thread (whose pool stays after the
    load) and steps it in another, which makes a pool of its own: on 2 cores, with both pools alive, a 73,728-
    element bf16 add in the stepping thread took 56 us against 7 us, a 128-token prefill step 70-80 ms against
    42 ms (AMD Zen 5). Called in the building thread once the engine steps elsewhere, it leaves the stepping
    thread's pool alone within the CPUs. Returns whether it was done (torch's OpenMP is libgomp, found loaded)."""
    gomp = libgomp()
    try:
        if gomp is None or gomp.omp_pause_resource_all(1) != 0:  # omp_pause_soft: the calling thread's pool goes
            return False
        gomp.omp_set_num_threads(1)
    except AttributeError:  # a libgomp older than OpenMP 5.0's pause
        return False
    return True


def libgomp():
    """The libgomp this process has loaded (torch's OpenMP on Linux), as a ``ctypes.CDLL``; None when none is."""
    import ctypes
    import re

    try:
        with open("/proc/self/maps") as maps:
            found = re.search(r"(/\S*libgomp[^/\s]*\.so[^/\s]*)", maps.read())
        return None if found is None else ctypes.CDLL(found.group(1))
    except OSError:
        return None
