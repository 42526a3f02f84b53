"""The token-budget scheduler, one per engine, and the hooks of the scheduling policy it calls.

Each step spends ``max_num_batched_tokens`` in this order:

1. running requests, in the order the policy gives (by default decodes first, one token each, then prefill
   chunks, so a long prompt never holds up the sequences already generating);
2. swapped-out requests, brought back when the pool has room again;
3. waiting requests, while the budget, ``max_num_seqs``, the KV pool and ``max_loras`` allow.

When the pool runs dry a running request (the policy's ``choose_victim``) is preempted: by ``recompute`` (its
blocks are freed, it waits at the front and is prefilled again, reusing the prefix cache) or by ``swap`` (its
blocks move to the CPU swap pool).

``schedule`` decides and :meth:`Scheduler.update` commits. ``schedule`` hands out blocks, moves requests
between its queues and records every decision in the ``SchedulerOutput`` (the position each request computes
from, its preemption, its failure); it writes no request's progress. ``update`` commits the step from the
runner's result: computed tokens, sampled tokens, the reset of a request preempted by recompute, the end of a
failed one. A step whose execution raises is undone by :meth:`Scheduler.rollback` instead.

With steps in flight the engine builds the next one with :meth:`Scheduler.schedule_excluding`: the requests
it names busy (those of steps in flight, and of the other steps' lanes) are passed over everywhere: not
scheduled, admitted, swapped in, preempted or failed.

A scheduling policy (the ``pagoda_schedulers`` component) is a :class:`SchedulingPolicy`: ``factory(scheduler,
**options)`` returns one, usually a subclass overriding a few hooks; ``options`` are its own
(``scheduler_options`` / ``--scheduler-options`` JSON), passed as keyword arguments. A policy only orders,
chooses and filters: its hooks read the scheduler's public state and act only through ``scheduler.preempt``.
Each hook's docstring says when it is called (``When:``) and ends with its default (``Default:``);
docs/plugins.md lists them from these docstrings (:func:`pagoda.scheduling.hook_table.hooks_markdown`). The
policy lives in this module with the scheduler so that a step's bookkeeping is one file.
"""

from __future__ import annotations

import bisect
import time
from typing import Any, Callable, Container, Iterable, Optional

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.errors import SchedulingPolicyError
from pagoda.interfaces import has_window_slots
from pagoda.kv.tiers import has_offload_tiers
from pagoda.sequence import FINISHED_STATUSES, Sequence, SequenceStatus
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

PolicyFactory = Callable[..., SchedulingPolicy]


class Scheduler:
    """Continuous batching with chunked prefill, preemption (recompute or swap) and n > 1 forking; the
    decisions of order, victim and admission are its policy's (``policy(self, **options)``).

    What a policy may use: the queues ``waiting``, ``running`` and ``swapped`` (read them, never change them),
    ``kv`` (the KV allocator; its queries), ``max_num_seqs``, ``max_num_batched_tokens``, and the methods
    :meth:`is_busy`, :meth:`was_preempted_in_this_step`, :meth:`would_fit`, :meth:`num_blocks_to_start` and
    :meth:`preempt`.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_manager,
                 policy: PolicyFactory = SchedulingPolicy, options: Optional[dict[str, Any]] = None,
                 max_loras: int = 0) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.num_speculative_tokens = scheduler_config.num_speculative_tokens
        # LoRA: the most distinct adapters the running requests may use at once (0: LoRA is off)
        self.max_loras = max_loras
        self.preemption_mode = cache_config.preemption_mode
        self.kv = kv_manager
        self._has_offload_tiers = has_offload_tiers(kv_manager)
        self._has_window_slots = has_window_slots(kv_manager)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.finished: list[Sequence] = []  # since the last drain_finished()
        self.num_preemptions = 0
        # n > 1: parent request id -> the sibling that computes the shared prompt for the others
        self._prompt_leaders: dict[str, Sequence] = {}
        # request id -> tokens scheduled in the step being built
        self._scheduled_now: dict[str, int] = {}
        # requests preempted in the step being built: none starts again before update() commits that
        self._preempted_now: set[str] = set()
        # the step being built leaves these request ids alone (schedule_excluding: steps still in flight)
        self._busy: Container[str] = ()
        # a KV connector's loads and saves (pagoda.kv.connector.KVTransfers), set by the engine when one is on
        self.kv_transfers: Any = None
        self.policy = policy(self, **(options or {}))
        missing = [hook for hook in HOOKS if not callable(getattr(self.policy, hook, None))]
        if missing:
            raise SchedulingPolicyError(
                f"{getattr(policy, '__name__', policy)!r} built a {type(self.policy).__name__}, which lacks the "
                f"scheduling policy hooks {missing}; a pagoda_schedulers component returns a "
                "pagoda.scheduling.SchedulingPolicy (subclass it: the hooks you leave out keep their defaults)")

    # ---- what a policy may ask and do --------------------------------------------------------------

    def is_busy(self, request: Sequence) -> bool:
        """Whether the step being built must leave ``request`` alone: it is in a step still in flight (or
        another step's lane, :meth:`schedule_excluding`), so it is neither scheduled nor preempted now."""
        return request.request_id in self._busy

    def was_preempted_in_this_step(self, request: Sequence) -> bool:
        """Whether ``request`` was preempted in the step being built: it may not start again before ``update()``
        commits that step."""
        return request.request_id in self._preempted_now

    def num_blocks_to_start(self, request: Sequence) -> int:
        """The KV blocks a waiting ``request`` would take to start now: its first chunk (within the budget of a
        whole step and ``long_prefill_token_threshold``), less what the prefix cache already holds."""
        computed_blocks, num_cached = self.kv.get_computed_blocks(request)
        num_new = self._num_new_tokens(request, self.max_num_batched_tokens, num_cached)
        return self.kv.num_blocks_to_take(request, num_new, computed_blocks)

    def would_fit(self, request: Sequence) -> bool:
        """Whether a waiting ``request`` would start if it were next: a seat is free (``max_num_seqs``) and the
        free KV blocks hold its first chunk (:meth:`num_blocks_to_start`, prefix-cache hits counted). For a
        policy that preempts for arrivals: preempt until the head request would fit."""
        return len(self.running) < self.max_num_seqs and self.num_blocks_to_start(request) <= self.kv.num_free_blocks

    def preempt(self, request: Sequence, out: SchedulerOutput) -> None:
        """Preempt a running request: its blocks are swapped out if configured and there is room, else freed to
        recompute it later (it waits again; :meth:`update` resets its computed tokens). Recorded in
        ``out.preempted``; it starts again in a later step, not this one. Refuses a busy request
        (:meth:`is_busy`), whose blocks a step in flight is using, and one that is not running."""
        if request.request_id in self._busy:
            raise SchedulingPolicyError(
                f"the {type(self.policy).__name__} policy preempted {request.request_id}, which is in a step still "
                "in flight; a policy passes over busy requests (self.scheduler.is_busy(request))")
        if request not in self.running:
            raise SchedulingPolicyError(
                f"the {type(self.policy).__name__} policy preempted {request.request_id}, which is not running "
                f"(it is {request.status.value}); only a request in scheduler.running can be preempted")
        self.running.remove(request)
        if self.preemption_mode == "swap" and self.kv.can_swap_out(request):
            out.blocks_to_swap_out.extend(self.kv.swap_out(request))
            request.status = SequenceStatus.SWAPPED
            self._insert(self.swapped, request, self.policy.running_key)
        else:
            self.kv.free(request)
            request.status = SequenceStatus.PREEMPTED
            self._insert_waiting(request, front=True)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_now.add(request.request_id)
        out.preempted.append(request)

    # ---- queries -------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- building a step -----------------------------------------------------

    def add_request(self, request: Sequence) -> None:
        self.requests[request.request_id] = request
        request.status = SequenceStatus.WAITING
        self.policy.on_request_added(request)
        self._insert_waiting(request)

    def schedule_excluding(self, busy: Container[str]) -> SchedulerOutput:
        """:meth:`schedule`, leaving alone the requests whose ids are in ``busy`` (see :meth:`is_busy`)."""
        self._busy = busy
        try:
            return self.schedule()
        finally:
            self._busy = ()

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._scheduled_now = {}
        self._preempted_now = set()
        self.policy.on_step_start()
        self.policy.preempt_for_arrivals(out)
        num_preempted_before = len(out.preempted)
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        pool_ran_dry = len(out.preempted) > num_preempted_before
        if not pool_ran_dry and not out.blocks_to_swap_out:
            # never swap in and out in one step: a freed swap slot could be overwritten before it is read
            budget = self._schedule_swapped(out, budget)
        if not pool_ran_dry and self.waiting:
            self._reorder_waiting()
            self._schedule_waiting(out, budget)
        out.blocks_to_copy.extend(self.kv.take_block_copies())
        if self._has_window_pool():
            out.window_blocks_to_copy.extend(self.kv.take_window_copies())
        if self._has_offload_tiers and self.kv.tiers is not None:
            out.kv_tier_moves = self.kv.take_tier_moves()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for req in self._running_order():
            if budget <= 0:
                break
            if req.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            is_decode = req.num_tokens - req.num_computed_tokens == 1
            # a decode computes its one token whatever the chunking settings (budget > 0 here)
            num_new = 1 if is_decode else self._num_new_tokens(req, budget)
            if num_new == 0:
                continue
            num_drafts = 0
            if self.num_speculative_tokens and is_decode:
                num_drafts = self._num_draft_slots(req, budget - 1)
                num_new += num_drafts
            if self._outgrows_cache(req, num_new):
                self._fail_unfittable(req, out)
                continue
            while not self.kv.allocate_slots(req, num_new):
                candidates = [r for r in self.running
                              if r.request_id not in self._scheduled_now and r.request_id not in self._busy]
                if not candidates:  # req itself would be one: it left the running queue by hand
                    raise SchedulingPolicyError(
                        f"{req.request_id} is {req.status.value} in the running order but not in the running queue, "
                        f"so no running request can be preempted to give it blocks (choose_victim has no "
                        f"candidates); a running request leaves the queue only through "
                        f"self.scheduler.preempt(request, out)")
                victim = self.policy.choose_victim(candidates)
                if not any(victim is c for c in candidates):
                    raise SchedulingPolicyError(
                        f"the {type(self.policy).__name__} policy's choose_victim returned "
                        f"{getattr(victim, 'request_id', victim)!r}, which is not one of its candidates "
                        f"{[c.request_id for c in candidates]}; return one of them")
                self.preempt(victim, out)
                if victim is req:
                    break
            else:
                self._add_to_output(out, req, num_new, req.num_computed_tokens, num_drafts)
                budget -= num_new
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        idx = 0
        while idx < len(self.swapped) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.swapped[idx]
            if req.request_id in self._busy or not self.policy.may_swap_in(req):
                idx += 1  # the policy keeps it out of this step; the ones behind it may come back
                continue
            if not self._fits_lora_slots(req):
                break
            num_new = self._num_new_tokens(req, budget)
            if num_new and self._outgrows_cache(req, num_new):
                self._fail_unfittable(req, out)
                continue
            if num_new == 0 or not self.kv.can_swap_in(req, num_new):
                break
            self.swapped.pop(idx)
            out.blocks_to_swap_in.extend(self.kv.swap_in(req))
            if not self.kv.allocate_slots(req, num_new):
                raise RuntimeError(f"KV bookkeeping error: {req.request_id} swapped in without room to run")
            req.status = SequenceStatus.RUNNING
            self._insert(self.running, req, self.policy.running_key)
            self._add_to_output(out, req, num_new, req.num_computed_tokens)
            budget -= num_new
        return budget

    def _has_window_pool(self) -> bool:
        """Whether the allocator keeps window slots now (pagoda.kv.window; turned on after the scheduler is built)."""
        return self._has_window_slots and self.kv.window is not None

    def _add_to_output(self, out: SchedulerOutput, req: Sequence, num_new: int, num_computed: int,
                       num_drafts: int = 0) -> None:
        window_table = self.kv.window_block_table(req.request_id) if self._has_window_pool() else None
        out.add(req, num_new, num_computed, self.kv.block_table(req.request_id), num_drafts, window_table)
        if self.kv_transfers is not None:
            self.kv_transfers.note_scheduled(out, req, num_computed, num_new, out.block_tables[-1])
        self._scheduled_now[req.request_id] = num_new
        self.policy.on_request_scheduled(req, num_new)

    # ---- admission and sizing -----------------------------------------------------------------------

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Start waiting requests in the order the policy's ``order_waiting`` gives, while the budget,
        ``max_num_seqs`` and the KV pool allow and the policy's ``may_admit`` agrees: a prefix-cache hit is
        shared, not recomputed, and a sequence of an ``n > 1`` request shares the prompt blocks its sibling (the
        prompt leader) computed. A request preempted in this step ends the admissions (its reset is not
        committed)."""
        now = time.monotonic()
        idx = 0
        while idx < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[idx]
            if req.request_id in self._busy:
                idx += 1  # another step's, in flight or next
                continue
            if req.request_id in self._preempted_now or not self.policy.may_admit(req):
                break
            if not self._fits_lora_slots(req):
                idx += 1  # its adapter would be one too many this step: it waits for a running one to finish
                continue
            leader = self._prompt_leader(req)
            if leader is not None and leader.num_computed_tokens < req.num_prompt_tokens - 1:
                idx += 1  # its sibling is still computing the shared prompt: join once that is done
                continue
            if leader is not None:
                start = num_new = self._fork_from(leader, req)
                if num_new == 0:
                    break
                num_new = 1
            else:
                computed_blocks, num_cached = self.kv.get_computed_blocks(req)
                # blocks a KV connector loads instead of this step computing them (see _external_blocks)
                external = self._external_blocks(req, num_cached)
                if external is None:
                    idx += 1  # their reads are still running: it waits, the requests behind it may start
                    continue
                num_loaded = len(external) * self.kv.block_size
                num_new = self._num_new_tokens(req, budget, num_cached + num_loaded)
                if num_new == 0:
                    break
                if not self.kv.allocate_slots(req, num_loaded + num_new, computed_blocks):
                    if not self.running:
                        # the whole pool is free and still too small: waiting would never end
                        self._fail_unfittable(req, out)
                        continue
                    break
                if self.kv_transfers is not None:
                    self._load_external(out, req, num_cached, external)
                start = num_cached + num_loaded
                req.num_cached_tokens = max(req.num_cached_tokens, start)
                if req.sampling_params.n > 1 and req.num_output_tokens == 0:
                    self._prompt_leaders.setdefault(req.parent_id, req)
            self.waiting.pop(idx)
            req.status = SequenceStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = now
            self._insert(self.running, req, self.policy.running_key)
            self._add_to_output(out, req, num_new, start)
            budget -= num_new

    def _external_blocks(self, req: Sequence, num_cached: int) -> Optional[list]:
        """With a KV connector: the verified blocks it loads for ``req`` after its ``num_cached`` prefix-cache
        tokens (``[]``: none), or None while their reads run. Without one: ``[]``."""
        if self.kv_transfers is None:
            return []
        return self.kv_transfers.blocks_for(req, num_cached)

    def _load_external(self, out: SchedulerOutput, req: Sequence, num_cached: int, external: list) -> None:
        """``req`` started with ``external`` blocks (after its ``num_cached`` tokens) to load: the runner copies
        them into the blocks it was given for those positions before the step's forward pass."""
        table = self.kv.block_table(req.request_id)
        first = num_cached // self.kv.block_size
        out.kv_connector.loads.extend((table[first + i], payload) for i, (_, payload) in enumerate(external))
        self.kv_transfers.admitted(req, len(external))

    def _fits_lora_slots(self, req: Sequence) -> bool:
        """Whether ``req`` may run beside the running requests without their LoRA adapters exceeding
        ``max_loras`` (a base-model request always may)."""
        lora = req.lora_request
        if lora is None or not self.max_loras:
            return True
        running = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return lora.lora_int_id in running or len(running) < self.max_loras

    def _prompt_leader(self, req: Sequence) -> Optional[Sequence]:
        """The running sibling whose prompt blocks ``req`` (one of ``n`` sequences) can share."""
        params = req.sampling_params
        if params.n <= 1 or params.prompt_logprobs is not None or req.num_output_tokens or req.num_prompt_tokens < 2:
            return None  # (prompt logprobs need every prompt position computed)
        leader = self._prompt_leaders.get(req.parent_id)
        if leader is None or leader is req or leader.status != SequenceStatus.RUNNING:
            self._prompt_leaders.pop(req.parent_id, None)
            return None
        return leader

    def _forget_leader(self, req: Sequence) -> None:
        """``req`` lost its blocks: no sibling forks from it any more."""
        if self._prompt_leaders.get(req.parent_id) is req:
            del self._prompt_leaders[req.parent_id]

    def _fork_from(self, leader: Sequence, req: Sequence) -> int:
        """Share the leader's prompt blocks and make room for the last prompt token, which this sequence
        computes for its own first sample. Returns the tokens shared (the position it computes from),
        0 if the pool is short."""
        num_shared = req.num_prompt_tokens - 1
        self.kv.fork(leader, req, num_shared)
        if not self.kv.allocate_slots(req, 1):
            self.kv.free(req)
            return 0
        return num_shared

    def _num_draft_slots(self, req: Sequence, budget: int) -> int:
        """Draft slots for a decoding request: ``num_speculative_tokens`` when its sampling allows
        speculation, within its ``max_tokens``, the budget and ``max_model_len``, and only if the blocks
        are free now (drafts never cost a preemption)."""
        if not req.may_speculate():
            return 0
        k = min(self.num_speculative_tokens, budget, self.max_model_len - req.num_tokens)
        if req.sampling_params.max_tokens is not None:
            k = min(k, req.sampling_params.max_tokens - req.num_output_tokens - 1)  # no drafts past the last token
        if k <= 0 or self._outgrows_cache(req, 1 + k) or not self.kv.can_allocate(req, 1 + k):
            return 0
        return k

    def _outgrows_cache(self, req: Sequence, num_new: int) -> bool:
        return self.kv.blocks_needed(req.num_computed_tokens + num_new) > self.kv.num_blocks

    def _fail_unfittable(self, req: Sequence, out: SchedulerOutput) -> None:
        """Take a request the whole cache cannot hold out of its queue and give back its blocks (the rest of
        the step may use them); ``update`` ends it with the error."""
        need = self.kv.blocks_needed(max(req.num_tokens, req.num_computed_tokens + 1))
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
                break
        self.kv.free(req)
        self._forget_leader(req)
        out.failed.append((req, (
            f"request {req.request_id} needs {need} KV blocks for its {req.num_tokens} tokens but the whole cache "
            f"has {self.kv.num_blocks}; raise --kv-cache-memory-bytes (or --num-gpu-blocks-override) or shorten "
            "the prompt / max_tokens")))

    def _num_new_tokens(self, req: Sequence, budget: int, num_computed: Optional[int] = None) -> int:
        """Tokens to compute this step: all that remain, or a chunk of them with chunked prefill
        (at most the budget and ``long_prefill_token_threshold``); 0 if a whole prompt does not fit."""
        remaining = req.num_tokens - (req.num_computed_tokens if num_computed is None else num_computed)
        if not self.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        num_new = min(remaining, budget)
        if self.long_prefill_token_threshold:
            num_new = min(num_new, self.long_prefill_token_threshold)
        return num_new

    # ---- queue order -------------------------------------------------------------------------------

    @staticmethod
    def _insert(queue: list[Sequence], request: Sequence, key: Callable[[Sequence], Any]) -> None:
        if key(request) is None:
            queue.append(request)
        else:
            bisect.insort(queue, request, key=key)

    def _insert_waiting(self, request: Sequence, front: bool = False) -> None:
        waiting_key = self.policy.waiting_key
        if waiting_key(request) is not None:
            bisect.insort(self.waiting, request, key=waiting_key)
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def _running_order(self) -> list[Sequence]:
        running = self.running
        if self._busy:
            running = [r for r in running if r.request_id not in self._busy]
        if running and self.policy.running_key(running[0]) is not None:
            order = list(running)
        else:
            decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
            order = decodes + [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        chosen = self.policy.order_running(order)
        if chosen is not order:
            allowed = set(map(id, order))
            if any(id(r) not in allowed for r in chosen):
                raise SchedulingPolicyError(
                    f"the {type(self.policy).__name__} policy's order_running returned a request that is not among "
                    "the running ones it was given; return some of those, in the order to serve them")
        return chosen

    def _reorder_waiting(self) -> None:
        ordered = self.policy.order_waiting(self.waiting)
        if ordered is self.waiting:
            return
        ordered = list(ordered)
        if len(ordered) != len(self.waiting) or set(map(id, ordered)) != set(map(id, self.waiting)):
            raise SchedulingPolicyError(
                f"the {type(self.policy).__name__} policy's order_waiting returned {len(ordered)} requests that are "
                f"not a reordering of the {len(self.waiting)} waiting ones; return the same requests, reordered")
        self.waiting = ordered

    # ---- committing a step ---------------------------------------------------

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Sequence]:
        """Commit the step: advance each request's computed tokens, append what it sampled (logprobs
        included), apply the stop conditions, free finished requests.

        A request computed its known tokens this step plus the drafts it had accepted; its newest
        token (sampled now) is computed next step. The step's other decisions are committed here
        too: a request preempted by recompute computes again from its first token, and requests
        that failed (in ``sched.failed`` or ``result.failed``) end with their error. Returns the
        requests that gained a token (finished ones included).
        """
        self.policy.on_step_executed(sched, result)
        if self.kv_transfers is not None and sched.kv_connector.saves:
            self.kv_transfers.save(sched, result.kv_saved)
        for req in sched.preempted:
            if req.status == SequenceStatus.PREEMPTED:  # by recompute (not swapped, not ended since)
                req.num_computed_tokens = 0
        for req, error in sched.failed:
            self.fail(req, error)
        progressed = []
        now = time.monotonic()
        max_model_len = self.max_model_len
        failed = result.failed
        for i, (req, token_ids, start, num_new, num_drafts, logprobs, prompt_lp) in enumerate(zip(
                sched.requests, result.sampled_token_ids, sched.num_computed_before, sched.num_new_tokens,
                sched.num_draft_slots, result.logprobs, result.prompt_logprobs, strict=True)):
            if req.status in FINISHED_STATUSES:
                continue  # aborted during the step
            if failed and i in failed:
                self.fail(req, failed[i])
                continue
            # after a recompute preemption the prompt is computed again; record it once
            if prompt_lp is not None and req.prompt_logprobs is not None and len(req.prompt_logprobs) == start + 1:
                req.prompt_logprobs.extend(prompt_lp)
            computed = start + num_new - num_drafts  # SchedulerOutput.num_real_tokens
            if not token_ids:
                req.num_computed_tokens = computed
                continue
            if req.is_prefill_only:  # its prompt is computed: that was all it asked for; no token is kept
                req.num_computed_tokens = computed
                self.finish(req, req.append_output_tokens(token_ids, max_model_len))
                continue
            req.num_computed_tokens = computed + len(token_ids) - 1
            if logprobs is not None and req.logprobs is not None:
                req.logprobs.append(logprobs)
            status = req.append_output_tokens(token_ids, max_model_len)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            progressed.append(req)
            if status is not None:
                self.finish(req, status)
            elif num_drafts:
                # release the blocks that only held rejected or unused draft slots
                self.kv.trim_slots(req, req.num_tokens)
        return progressed

    def rollback(self, sched: SchedulerOutput) -> None:
        """Undo what a step that failed to execute may have left half done.

        No request's progress moved (that happens in :meth:`update`), but the step's block moves,
        copy-on-write copies and K/V writes may have run in part, and blocks registered in the prefix
        cache for this step's tokens hold nothing valid. So the prefix cache is dropped, and the
        step's requests (and those it swapped out) lose their KV blocks and wait at the front of the
        queue to be computed again from their tokens: their outputs continue exactly as before.
        Requests the step failed (``sched.failed``) end with their error, as in :meth:`update`.
        """
        for req, error in sched.failed:
            self.fail(req, error)
        if self.kv_transfers is not None:
            self.kv_transfers.drop_saves(sched)
        self.kv.reset_prefix_cache()
        for req in list(sched.requests) + list(sched.preempted):
            if req.is_finished or req.status == SequenceStatus.PREEMPTED:
                continue
            for queue in (self.running, self.swapped):
                if req in queue:
                    queue.remove(req)
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = SequenceStatus.PREEMPTED
            self._forget_leader(req)
            self._insert_waiting(req, front=True)

    def finish(self, req: Sequence, status: SequenceStatus) -> None:
        """Finish a request in any state (waiting, running, swapped) and free its blocks at once."""
        if req.is_finished:
            return
        self.policy.on_request_finished(req)
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
                break
        req.status = status
        self.kv.free(req)
        self._forget_leader(req)
        if self.kv_transfers is not None:
            self.kv_transfers.forget(req)
        self.requests.pop(req.request_id, None)
        self.finished.append(req)

    def fail(self, req: Sequence, error: str) -> None:
        """End a request for an error (what was wrong and how to fix it), in any state; its blocks are freed."""
        if req.is_finished:
            return
        req.error = error
        self.finish(req, SequenceStatus.FINISHED_ERROR)

    def drain_finished(self) -> list[Sequence]:
        """Requests finished since the last call (stopped, length, aborted or failed)."""
        finished, self.finished = self.finished, []
        return finished

    def abort_requests(self, request_ids: Iterable[str]) -> list[Sequence]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish(req, SequenceStatus.FINISHED_ABORTED)
                aborted.append(req)
        return aborted
