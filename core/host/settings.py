"""Host settings applied to the process: when an engine is built, and per step while it runs.

Importing pagoda changes nothing in the process. The settings are engine
options (``HostConfig``, resolved once with environment variables as their
defaults); an engine applies its own when it is built (``apply_host_settings``)
and keeps its threads and heap in shape as it steps (``HostTuning``).

One setting cannot wait for an engine: OpenMP reads its wait policy when torch
loads it. The ``pagoda`` command chooses it before importing torch; a program
calls ``set_openmp_wait_policy()`` before its first ``import torch`` (or sets
``OMP_WAIT_POLICY`` itself).

This module imports no torch, so it can run before torch is loaded.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, Optional

from pagoda.host import malloc, openmp
from pagoda.host.env import HOST_VARIABLES, env_choice, parse_choice

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.host.env import HostConfig
    from pagoda.host.threads import ThreadGovernor

logger = logging.getLogger("pagoda")

# The settings of the engine built last, read by layer code too deep to be handed a config (fused kernels,
# oneDNN packing, the ISA cap of kernel builds). Written only by apply_host_settings.
_current: Optional[HostConfig] = None


def current() -> HostConfig:
    """The host settings in effect: those of the engine built last; before any engine, the environment
    variables' (read once), so kernels used without an engine follow them too."""
    global _current
    if _current is None:
        from pagoda.host.env import resolve_host_config

        _current = resolve_host_config()
    return _current


def apply_host_settings(host: HostConfig) -> None:
    """Apply an engine's host settings to the process: the allocator tuning and the switches layer code
    reads through ``current()`` (fused kernels, oneDNN packing, the ISA cap, huge pages). Warns when an
    OpenMP wait policy was asked for that can no longer take effect."""
    global _current
    if host.malloc_tuning:
        malloc.keep_freed_memory()
    _current = host
    policy = host.omp_wait_policy
    if policy != "auto" and openmp.requested_policy != policy and not openmp.is_set_by_user():
        logger.warning(
            "omp_wait_policy=%r cannot take effect: OpenMP read its settings when torch was imported. Call "
            "pagoda.host.settings.set_openmp_wait_policy(%r) before importing torch (the pagoda command does this for "
            "--omp-wait-policy), or set OMP_WAIT_POLICY yourself", policy, policy)


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
    """The engine's care of the machine while it steps: the compute thread count (measured again now and
    then unless set) and huge pages for the heap as the activations grow it.

    A step observer: the engine calls ``before_step`` once a step is scheduled and ``after_step`` once it ran.
    """

    def __init__(self, config: EngineConfig) -> None:
        from pagoda.host.threads import ThreadGovernor, configure_threads

        requested = config.parallel.cpu_threads
        self.num_threads = configure_threads(requested)
        # a measured count is measured again now and then (see ThreadGovernor); a set one stays
        self.governor: Optional[ThreadGovernor] = ThreadGovernor.for_setting(
            requested, self.num_threads, config.host.thread_recheck_seconds)
        self.huge_pages = config.host.huge_pages
        self._largest_step = 0  # tokens of the largest step so far

    @property
    def observes_steps(self) -> bool:
        """Whether it has anything to do per step; the engine calls it only then."""
        return self.governor is not None or self.huge_pages

    def hold_threads(self) -> None:
        """Keep the current thread count for the rest of the run (benchmarks compare one configuration)."""
        self.governor = None

    def before_step(self, engine: Any, sched: Any) -> None:
        """Nothing to prepare: the heap grows while a step runs, so its pages are advised after it."""

    def after_step(self, engine: Any, sched: Any, result: Any, seconds: float) -> None:
        """Advise huge pages for the heap after a step larger than any before; re-measure the thread count
        when the governor's interval has passed (``result`` None: nothing ran, nothing to learn)."""
        if self.huge_pages and sched.num_batched_tokens > 1.25 * self._largest_step:
            # the heap just grew to hold this step's activations: back it with huge pages (a few times in a
            # process's life: each advice collapses what the heap gained since the last)
            from pagoda.host import hugepages

            self._largest_step = sched.num_batched_tokens
            hugepages.advise_heap()
        if self.governor is not None and result is not None:
            self.num_threads = self.governor.maybe_retune()
