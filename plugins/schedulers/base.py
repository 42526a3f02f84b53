"""The token-budget scheduler that the built-in policies share.

Each step spends ``max_num_batched_tokens`` in this order:

1. running requests: decodes first (one token each), then prefill chunks, so
   a long prompt never holds up the sequences already generating;
2. swapped-out requests, brought back when the pool has room again;
3. waiting requests, while the budget, ``max_num_seqs`` and the KV pool allow.

When the pool runs dry a running request is preempted: by ``recompute`` (its
blocks are freed, it waits at the front and is prefilled again, reusing the
prefix cache) or by ``swap`` (its blocks move to the CPU swap pool). Policies
differ in the order requests queue in, which running request is preempted,
and whether an arrival may preempt running work.

Progress is committed in :meth:`TokenBudgetScheduler.update`, from the
runner's result: ``schedule`` hands out blocks and picks the step's requests
but moves no request's computed-token count, so a step whose execution raises
leaves every request where it was (see :meth:`TokenBudgetScheduler.rollback`).
"""

from __future__ import annotations

import bisect
import time
from typing import Any, Callable, Iterable, Optional

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv.tiers import has_offload_tiers
from pagoda.plugins.schedulers.admission import WaitingAdmission
from pagoda.registry.deprecation import adopt_renamed_overrides
from pagoda.sequence import FINISHED_STATUSES, Sequence, SequenceStatus
from pagoda.step import RunnerOutput, SchedulerOutput


class TokenBudgetScheduler(WaitingAdmission):
    """Continuous batching with chunked prefill, preemption (recompute or swap) and n > 1 forking."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_manager) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.num_speculative_tokens = scheduler_config.num_speculative_tokens
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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # a policy overriding a renamed method is warned about (or, once the old name is removed, refused)
        super().__init_subclass__(**kwargs)
        adopt_renamed_overrides(cls, TokenBudgetScheduler)

    # ---- policy: the public methods a scheduling policy overrides ----------------------------------

    def waiting_key(self, request: Sequence) -> Optional[Any]:
        """The waiting queue's order: requests with smaller keys are admitted first. None (the default)
        keeps arrival order, with preempted requests resuming before anything new starts. A policy
        that returns keys orders preempted requests too (``request.num_preemptions`` tells them apart)."""
        return None

    def running_key(self, request: Sequence) -> Optional[Any]:
        """The order of the running and swapped queues, which is also the order running requests get
        budget and blocks. None (the default): arrival order, and each step serves decodes (one token
        each) before prefill chunks, so a long prompt never holds up the sequences already generating."""
        return None

    def choose_victim(self, candidates: list[Sequence]) -> Sequence:
        """The request to preempt when blocks run out, among ``candidates`` (running requests not yet
        scheduled this step, in running order): by default the newest one."""
        return candidates[-1]

    def may_admit(self, request: Sequence) -> bool:
        """Whether a waiting request may start now, while others sit swapped out: by default not
        (swapped requests come back first)."""
        return not self.swapped

    def preempt_for_arrivals(self, out: SchedulerOutput) -> None:
        """Called first in every step: preempt running work in favour of waiting requests, with
        :meth:`preempt`. By default never (first come, first served)."""

    def order_waiting(self, waiting: list[Sequence]) -> list[Sequence]:
        """Called in every step before waiting requests are admitted, with the waiting queue in its
        current order: returns the same requests in the order to try them this step (the queue keeps
        that order). For orders that change as the KV cache changes (such as the longest cached
        prefix first), which a key fixed on arrival (:meth:`waiting_key`) cannot express. By default
        the queue as it is."""
        return waiting

    # ---- actions a policy may take -------------------------------------------------------------

    def preempt(self, request: Sequence, out: SchedulerOutput) -> None:
        """Preempt a running request: its blocks are swapped out if configured and there is room, else
        freed to recompute it later (it waits again). Recorded in ``out.preempted``."""
        self.running.remove(request)
        if self.preemption_mode == "swap" and self.kv.can_swap_out(request):
            out.blocks_to_swap_out.extend(self.kv.swap_out(request))
            request.status = SequenceStatus.SWAPPED
            self._insert_swapped(request)
        else:
            self.kv.free(request)
            request.num_computed_tokens = 0
            request.status = SequenceStatus.PREEMPTED
            self._insert_waiting(request, front=True)
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)

    # ---- queue order, from waiting_key and running_key (private helpers, not extension points) --------

    @staticmethod
    def _insert(queue: list[Sequence], request: Sequence, key: Callable[[Sequence], Any]) -> None:
        if key(request) is None:
            queue.append(request)
        else:
            bisect.insort(queue, request, key=key)

    def _insert_waiting(self, request: Sequence, front: bool = False) -> None:
        if self.waiting_key(request) is not None:
            bisect.insort(self.waiting, request, key=self.waiting_key)
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def _insert_running(self, request: Sequence) -> None:
        self._insert(self.running, request, self.running_key)

    def _insert_swapped(self, request: Sequence) -> None:
        self._insert(self.swapped, request, self.running_key)

    def _running_order(self) -> list[Sequence]:
        running = self.running
        if running and self.running_key(running[0]) is not None:
            return list(running)
        # (len(all_token_ids) is num_tokens without the property call: this runs for every request every step)
        decodes = [r for r in running if len(r.all_token_ids) - r.num_computed_tokens == 1]
        if len(decodes) == len(running):
            return decodes
        return decodes + [r for r in running if len(r.all_token_ids) - r.num_computed_tokens > 1]

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

    # ---- actions -------------------------------------------------------------

    def add_request(self, request: Sequence) -> None:
        self.requests[request.request_id] = request
        request.status = SequenceStatus.WAITING
        self._insert_waiting(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._scheduled_now = {}
        self.preempt_for_arrivals(out)
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
        # the hot loop (every running request, every step): helpers inlined, attributes read once
        kv, running_status, scheduled_now = self.kv, SequenceStatus.RUNNING, self._scheduled_now
        allocate_slots, block_table, blocks_needed = kv.allocate_slots, kv.block_table, kv.blocks_needed
        num_cache_blocks, add = kv.num_blocks, out.add
        for req in self._running_order():
            if budget <= 0:
                break
            if req.status is not running_status:
                continue  # preempted earlier in this loop
            num_computed = req.num_computed_tokens
            is_decode = len(req.all_token_ids) - num_computed == 1
            # a decode computes its one token whatever the chunking settings (budget > 0 here)
            num_new = 1 if is_decode else self._num_new_tokens(req, budget)
            if num_new == 0:
                continue
            num_drafts = 0
            if self.num_speculative_tokens and is_decode:
                num_drafts = self._num_draft_slots(req, budget - 1)
                num_new += num_drafts
            if blocks_needed(num_computed + num_new) > num_cache_blocks:  # _outgrows_cache
                self._fail_unfittable(req)
                continue
            while not allocate_slots(req, num_new):
                candidates = [r for r in self.running if r.request_id not in scheduled_now]
                victim = self.choose_victim(candidates)
                self.preempt(victim, out)
                if victim is req:
                    break
            else:
                add(req, num_new, num_computed, block_table(req.request_id), num_drafts)  # _add_to_output
                scheduled_now[req.request_id] = num_new
                budget -= num_new
        return budget

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

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.swapped[0]
            num_new = self._num_new_tokens(req, budget)
            if num_new and self._outgrows_cache(req, num_new):
                self._fail_unfittable(req)
                continue
            if num_new == 0 or not self.kv.can_swap_in(req, num_new):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(self.kv.swap_in(req))
            if not self.kv.allocate_slots(req, num_new):
                raise RuntimeError(f"KV bookkeeping error: {req.request_id} swapped in without room to run")
            req.status = SequenceStatus.RUNNING
            self._insert_running(req)
            self._add_to_output(out, req, num_new)
            budget -= num_new
        return budget

    def _outgrows_cache(self, req: Sequence, num_new: int) -> bool:
        return self.kv.blocks_needed(req.num_computed_tokens + num_new) > self.kv.num_blocks

    def _fail_unfittable(self, req: Sequence) -> None:
        need = self.kv.blocks_needed(max(req.num_tokens, req.num_computed_tokens + 1))
        req.error = (
            f"request {req.request_id} needs {need} KV blocks for its {req.num_tokens} tokens but the whole cache "
            f"has {self.kv.num_blocks}; raise --kv-cache-memory-bytes (or --num-gpu-blocks-override) or shorten "
            "the prompt / max_tokens"
        )
        self.finish(req, SequenceStatus.FINISHED_ERROR)

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

    def _add_to_output(self, out: SchedulerOutput, req: Sequence, num_new: int, num_drafts: int = 0) -> None:
        out.add(req, num_new, req.num_computed_tokens, self.kv.block_table(req.request_id), num_drafts)
        self._scheduled_now[req.request_id] = num_new

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Sequence]:
        """Commit the step: advance each request's computed tokens, append what it sampled (logprobs
        included), apply the stop conditions, free finished requests.

        A request computed its known tokens this step plus the drafts it had accepted; its newest
        token (sampled now) is computed next step. Returns the requests that gained a token
        (finished ones included).
        """
        progressed = []
        now = time.monotonic()
        max_model_len = self.max_model_len
        for req, token_ids, start, num_new, num_drafts, logprobs, prompt_lp in zip(
                sched.requests, result.sampled_token_ids, sched.num_computed_before, sched.num_new_tokens,
                sched.num_draft_slots, result.logprobs, result.prompt_logprobs, strict=True):
            if req.status in FINISHED_STATUSES:
                continue  # aborted or failed during the step
            # after a recompute preemption the prompt is computed again; record it once
            if prompt_lp is not None and req.prompt_logprobs is not None and len(req.prompt_logprobs) == start + 1:
                req.prompt_logprobs.extend(prompt_lp)
            computed = start + num_new - num_drafts  # SchedulerOutput.num_real_tokens
            if not token_ids:
                req.num_computed_tokens = computed
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
        """
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
            if self._prompt_leaders.get(req.parent_id) is req:
                del self._prompt_leaders[req.parent_id]
            self._insert_waiting(req, front=True)

    def finish(self, req: Sequence, status: SequenceStatus) -> None:
        """Finish a request in any state (waiting, running, swapped) and free its blocks at once."""
        if req.is_finished:
            return
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
                break
        req.status = status
        self.kv.free(req)
        if self._prompt_leaders.get(req.parent_id) is req:
            del self._prompt_leaders[req.parent_id]
        self.requests.pop(req.request_id, None)
        self.finished.append(req)

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


class FCFSScheduler(TokenBudgetScheduler):
    """``fcfs``: first come, first served. The base scheduler's defaults already are: arrival order, the
    newest running request preempted first, and no arrival ever preempts running work."""
