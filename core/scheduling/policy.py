"""The hooks a scheduling policy answers; the defaults are first come, first served.

A policy is the ``pagoda_schedulers`` component: ``factory(scheduler, **options)`` returns a
:class:`SchedulingPolicy` (usually a subclass overriding a few hooks). ``scheduler`` is the
:class:`pagoda.scheduling.Scheduler` that calls the hooks; ``options`` are the policy's own options
(``scheduler_options`` / ``--scheduler-options`` JSON), passed as keyword arguments. The scheduler owns every
invariant (the token budget, ``max_num_seqs``, KV blocks, swap, one commit of progress in ``update``); a
policy only orders, chooses and filters. Its hooks read the scheduler's public state (``waiting``, ``running``,
``swapped``, ``kv``, ``max_num_seqs``, ``max_num_batched_tokens``) and act only through ``scheduler.preempt``.

Each hook's docstring starts with when it is called and ends with its default; docs/plugins.md lists them from
:data:`HOOKS` (a test checks the two agree).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from pagoda.scheduling.scheduler import Scheduler
    from pagoda.sequence import Sequence
    from pagoda.step import RunnerOutput, SchedulerOutput


class SchedulingPolicy:
    """The default policy (``fcfs``): arrival order, the newest running request preempted first, no arrival
    preempts running work. A subclass overrides the hooks it needs; its ``__init__`` takes
    ``(scheduler, **options)``, calls ``super().__init__(scheduler)`` and checks its options, raising
    ``ValueError`` naming the option that is wrong."""

    def __init__(self, scheduler: "Scheduler") -> None:
        self.scheduler = scheduler

    # ---- order ---------------------------------------------------------------------------------

    def waiting_key(self, request: "Sequence") -> Optional[Any]:
        """When: each time a request joins the waiting queue (on arrival and after a preemption by recompute).
        Returns its sort key: smaller keys are admitted first; the key must not change while the request waits
        (an order that changes belongs in ``order_waiting``). A policy that returns keys orders preempted
        requests too (``request.num_preemptions`` tells them apart).
        Default: None, arrival order, with preempted requests resuming before anything new starts."""
        return None

    def running_key(self, request: "Sequence") -> Optional[Any]:
        """When: each time a request joins the running or the swapped queue. Returns its sort key: the order
        running requests get each step's budget and blocks, and swapped ones come back.
        Default: None, arrival order, with decodes (one token each) served before prefill chunks, so a long
        prompt never holds up the sequences already generating."""
        return None

    def order_waiting(self, waiting: list["Sequence"]) -> list["Sequence"]:
        """When: once per step, before waiting requests are admitted, with the waiting queue in its current
        order. Returns the same requests in the order to try them (the queue keeps that order); for orders that
        change as the KV cache changes, which a key fixed on arrival cannot express.
        Default: the queue as it is."""
        return waiting

    def order_running(self, running: list["Sequence"]) -> list["Sequence"]:
        """When: once per step, before running requests get the budget, with the running requests that are not
        busy, in the order ``running_key`` (or decodes first) gives. Returns the requests to serve this step, in
        that order: a policy may reorder them and leave some out (they keep their blocks and wait a step).
        Default: the order as given."""
        return running

    # ---- decisions -----------------------------------------------------------------------------

    def choose_victim(self, candidates: list["Sequence"]) -> "Sequence":
        """When: a running request needs blocks and the pool is empty, once per preemption; ``candidates`` (never
        empty) are the running requests neither scheduled in this step nor busy, in running order. Returns one
        of them, which the scheduler preempts.
        Default: the newest, ``candidates[-1]``."""
        return candidates[-1]

    def may_admit(self, request: "Sequence") -> bool:
        """When: for every waiting request the step tries to start, in order, whether or not others are
        swapped out. False ends this step's admissions (the requests behind it wait too).
        Default: True while no request is swapped out (swapped requests come back first), else False."""
        return not self.scheduler.swapped

    def may_swap_in(self, request: "Sequence") -> bool:
        """When: for every swapped-out request the step could bring back, in swapped order. False keeps it out
        of this step; the ones behind it may still come back.
        Default: True."""
        return True

    def preempt_for_arrivals(self, out: "SchedulerOutput") -> None:
        """When: first in every step, before any request is scheduled. May preempt running requests in favour
        of waiting ones with ``self.scheduler.preempt(request, out)``, never a busy one
        (``self.scheduler.is_busy(request)``); ``self.scheduler.would_fit(request)`` says whether a waiting
        request could start now.
        Default: does nothing (no arrival preempts running work)."""

    # ---- events --------------------------------------------------------------------------------

    def on_step_start(self) -> None:
        """When: at the start of every ``schedule()``, before ``preempt_for_arrivals``.
        Default: does nothing."""

    def on_request_added(self, request: "Sequence") -> None:
        """When: a request arrives, before it joins the waiting queue (so ``waiting_key`` may read what this
        hook recorded).
        Default: does nothing."""

    def on_request_scheduled(self, request: "Sequence", num_new_tokens: int) -> None:
        """When: a request is put in the step being built (running, swapped in or admitted), with the tokens it
        computes in it. It must not change the request (only ``update()`` commits progress).
        Default: does nothing."""

    def on_step_executed(self, sched: "SchedulerOutput", result: "RunnerOutput") -> None:
        """When: in ``update()``, with a step and the runner's result, before the step is committed (so a
        request that ends in this step is still live here).
        Default: does nothing."""

    def on_request_finished(self, request: "Sequence") -> None:
        """When: a request ends (stopped, length, aborted or failed), before its blocks are freed; once per
        request.
        Default: does nothing."""


# every hook, in the order docs/plugins.md lists them
HOOKS = ("waiting_key", "running_key", "order_waiting", "order_running", "choose_victim", "may_admit",
         "may_swap_in", "preempt_for_arrivals", "on_step_start", "on_request_added", "on_request_scheduled",
         "on_step_executed", "on_request_finished")


def _docstring(name: str) -> str:
    return " ".join(getattr(SchedulingPolicy, name).__doc__.split())


def hook_default(name: str) -> str:
    """The documented default of hook ``name``: its docstring after ``Default:``."""
    return _docstring(name).rpartition("Default: ")[2]


def hook_when(name: str) -> str:
    """When hook ``name`` is called and what it answers: its docstring from ``When:`` to ``Default:``."""
    return _docstring(name).partition("When: ")[2].partition(" Default: ")[0]


def hooks_markdown() -> str:
    """The table of docs/plugins.md listing every hook, when it is called and its default, from the docstrings
    above (tests/test_scheduling_policy.py checks the page holds exactly this)."""
    rows = ["| hook | when it is called, and what it answers | default (`fcfs`) |", "|---|---|---|"]
    for name in HOOKS:
        params = list(inspect.signature(getattr(SchedulingPolicy, name)).parameters)[1:]
        rows.append(f"| `{name}({', '.join(params)})` | {hook_when(name)} | {hook_default(name)} |")
    return "\n".join(rows).replace("``", "`") + "\n"
