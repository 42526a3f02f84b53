"""The token-budget scheduler: one per engine, calling its policy's hooks (:mod:`pagoda.scheduling.policy`).

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
"""

from __future__ import annotations

import bisect
import time
from typing import Any, Callable, Container, Iterable, Optional

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.errors import SchedulingPolicyError
from pagoda.kv.tiers import has_offload_tiers
from pagoda.scheduling.admission import Admission
from pagoda.scheduling.policy import SchedulingPolicy
from pagoda.sequence import FINISHED_STATUSES, Sequence, SequenceStatus
from pagoda.step import RunnerOutput, SchedulerOutput

PolicyFactory = Callable[..., SchedulingPolicy]


class Scheduler(Admission):
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
        self.policy = policy(self, **(options or {}))

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

    def _add_to_output(self, out: SchedulerOutput, req: Sequence, num_new: int, num_computed: int,
                       num_drafts: int = 0) -> None:
        out.add(req, num_new, num_computed, self.kv.block_table(req.request_id), num_drafts)
        self._scheduled_now[req.request_id] = num_new
        self.policy.on_request_scheduled(req, num_new)

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
