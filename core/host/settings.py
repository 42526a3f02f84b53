"""The host settings that hold for the whole process, applied when an engine is built.

Importing pagoda changes nothing in the process. The host settings are engine
options (``HostConfig``, resolved once with environment variables as their
defaults). Most belong to one engine and travel with its config to the
components it builds (``ModelConfig.host``): which CPU kernels run, whether its
KV cache and weights get huge pages. A few hold for the whole process by nature
(``pagoda.host.env.PROCESS_WIDE``): torch's compute thread count and its
re-checks, the OpenMP wait policy, the allocator tuning. ``HostTuning`` applies
those when an engine is built and warns when they differ from those of another
engine alive in the same process, saying what that does to it.

One setting cannot wait for an engine: OpenMP reads its wait policy when torch
loads it. The ``pagoda`` command chooses it before importing torch; a program
calls ``set_openmp_wait_policy()`` before its first ``import torch`` (or sets
``OMP_WAIT_POLICY`` itself).

This module imports no torch, so it can run before torch is loaded.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import TYPE_CHECKING, Any, Optional

from pagoda.host import malloc, openmp
from pagoda.host.env import HOST_VARIABLES, env_choice, parse_choice

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.host.env import HostConfig
    from pagoda.host.threads import ThreadGovernor

logger = logging.getLogger("pagoda")

# The HostTuning of every engine alive in this process, with its settings: the process's own state (threads,
# allocator) is shared by them, so a new engine is checked against these. Weak: an engine that is gone holds
# nothing. Written only by HostTuning.__init__.
_live_engines: weakref.WeakKeyDictionary[HostTuning, HostConfig] = weakref.WeakKeyDictionary()


def set_openmp_wait_policy(policy: Optional[str] = None) -> str:
    """Choose how idle OpenMP threads wait; call it before torch is imported. Returns the choice, in words.

    ``policy`` is ``auto`` (spin briefly on an idle machine, sleep when others are runnable), ``spin`` or
    ``sleep``; None takes ``PAGODA_OMP_WAIT_POLICY``, else ``auto``. ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``
    already in the environment win. Once torch is loaded the environment is left alone and a warning says so.
    """
    variable = HOST_VARIABLES["omp_wait_policy"]
    if policy is None:
        policy = env_choice(variable, openmp.WAIT_POLICIES, "auto")
    else:
        policy = parse_choice(policy, "omp_wait_policy", openmp.WAIT_POLICIES)
    if "torch" in sys.modules:
        logger.warning("the OpenMP wait policy is chosen before torch is imported, and torch already is; "
                       "call pagoda.host.settings.set_openmp_wait_policy() before the first import of torch")
        return openmp.wait_policy
    return openmp.choose_wait_policy(policy)


class HostTuning:
    """An engine's process-wide host settings, applied when the engine is built: the compute thread count (set,
    or measured; an engine built while another is alive shares its count unless set), the allocator tuning, and
    a check of the OpenMP wait policy.

    Nothing of it runs per step unless thread re-checks are on (``thread_recheck_seconds`` above 0 with a
    measured count): then it is a step observer, and ``after_step`` re-measures now and then.
    """

    def __init__(self, config: EngineConfig) -> None:
        from pagoda.host.threads import ThreadGovernor, configure_threads

        host = config.host
        requested = config.parallel.cpu_threads
        others = list(_live_engines.items())
        _warn_of_conflicts(host, requested, others)
        if host.malloc_tuning:
            malloc.keep_freed_memory()
        _check_wait_policy(host.omp_wait_policy)
        # a measured count: the one the engines alive here already compute on, else measured now
        shared = others[-1][0].num_threads if requested is None and others else None
        self.num_threads = configure_threads(requested or shared)
        # a measured count is measured again now and then if asked for (see ThreadGovernor); a set one stays
        self.governor: Optional[ThreadGovernor] = ThreadGovernor.for_setting(
            requested, self.num_threads, host.thread_recheck_seconds)
        _live_engines[self] = host

    @property
    def observes_steps(self) -> bool:
        """Whether it has anything to do per step (thread re-checks); the engine calls it only then."""
        return self.governor is not None

    def hold_threads(self) -> None:
        """Keep the current thread count for the rest of the run (benchmarks compare one configuration)."""
        self.governor = None

    def before_step(self, engine: Any, sched: Any) -> None:
        """Nothing to prepare."""

    def after_step(self, engine: Any, sched: Any, result: Any, seconds: float) -> None:
        """Re-measure the thread count when the governor's interval has passed (``result`` None: nothing ran,
        nothing to learn)."""
        if self.governor is not None and result is not None:
            self.num_threads = self.governor.maybe_retune()


def _check_wait_policy(policy: str) -> None:
    """Warn when an OpenMP wait policy was asked for that can no longer take effect."""
    if policy != "auto" and openmp.requested_policy != policy and not openmp.is_set_by_user():
        logger.warning(
            "omp_wait_policy=%r cannot take effect: OpenMP read its settings when torch was imported. Call "
            "pagoda.host.settings.set_openmp_wait_policy(%r) before importing torch (the pagoda command does this for "
            "--omp-wait-policy), or set OMP_WAIT_POLICY yourself", policy, policy)


def _warn_of_conflicts(host: HostConfig, requested_threads: Optional[int],
                       others: list[tuple[HostTuning, HostConfig]]) -> None:
    """Warn, once per setting, where a new engine's process-wide settings differ from those of an engine alive
    in this process: what each does to the engine already running, and how to avoid it."""
    thread_counts = sorted({tuning.num_threads for tuning, _ in others} - {requested_threads})
    if requested_threads is not None and thread_counts:
        logger.warning(
            "cpu_threads=%d differs from the %s compute threads of an engine already running in this process; "
            "torch's thread count is one per process, so that engine computes on %d threads from now on too. Give "
            "every engine of a process the same cpu_threads, or leave it unset in later engines to share the "
            "first one's", requested_threads, " / ".join(map(str, thread_counts)), requested_threads)
    if host.malloc_tuning and any(not theirs.malloc_tuning for _, theirs in others):
        logger.warning(
            "malloc_tuning=True tunes the allocator of the whole process, so the engine already running here with "
            "malloc_tuning=False gets a tuned allocator too; give every engine of a process the same malloc_tuning")
    if not host.malloc_tuning and any(theirs.malloc_tuning for _, theirs in others):
        logger.warning(
            "malloc_tuning=False cannot take effect: an engine already running in this process tuned the allocator, "
            "which holds for the whole process and is not undone; give every engine of a process the same "
            "malloc_tuning")
    recheck = {theirs.thread_recheck_seconds for _, theirs in others} - {host.thread_recheck_seconds}
    if recheck and (host.thread_recheck_seconds > 0 or any(r > 0 for r in recheck)):
        logger.warning(
            "thread_recheck_seconds=%g differs from %s of an engine already running in this process; a re-check "
            "sets torch's thread count for the whole process, so it changes the other engine's threads too",
            host.thread_recheck_seconds, " / ".join(f"{r:g}" for r in sorted(recheck)))
    policies = {theirs.omp_wait_policy for _, theirs in others} - {host.omp_wait_policy, "auto"}
    if host.omp_wait_policy != "auto" and policies:
        logger.warning(
            "omp_wait_policy=%r differs from %s of an engine already running in this process; OpenMP has one wait "
            "policy per process, chosen before torch loads, so neither engine gets a policy of its own",
            host.omp_wait_policy, " / ".join(sorted(map(repr, policies))))
