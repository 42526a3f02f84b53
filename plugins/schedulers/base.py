"""The token-budget scheduler that the built-in policies share.

Each step it gives every running request its next tokens (one for a decode,
a chunk for a prefill) out of ``max_num_batched_tokens``, then admits waiting
requests while the budget, ``max_num_seqs`` and the KV pool allow. Policies
differ in two places: the order requests wait in, and which running request
gives up its blocks when the pool runs dry.
"""

from __future__ import annotations

import time
from typing import Iterable, Optional

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.request import Request, RequestStatus
from pagoda.scheduler_output import SchedulerOutput


class TokenBudgetScheduler:
    """Continuous batching with chunked prefill and recompute preemption."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_manager) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.kv = kv_manager
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished: list[Request] = []  # since the last drain_finished()
        self.num_preemptions = 0

    # ---- policy points -------------------------------------------------------

    def _insert_waiting(self, request: Request, front: bool = False) -> None:
        if front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def _pick_victim(self, candidates: list[Request]) -> Request:
        """The request to preempt when blocks run out, among ``candidates``
        (running requests not yet scheduled this step): the newest one."""
        return candidates[-1]

    # ---- queries -------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- actions -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self._insert_waiting(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.monotonic()

        # 1. running requests, oldest first, preempting from the back when the pool is dry
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._num_new_tokens(req, budget)
            if num_new == 0:
                i += 1
                continue
            scheduled = True
            while not self.kv.allocate_slots(req, num_new):
                victim = self._pick_victim(self.running[i:])
                self._preempt(victim, out)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                continue  # req left self.running; index i now holds the next one
            self._add_to_output(out, req, num_new)
            budget -= num_new
            i += 1

        # 2. waiting requests, unless this step already had to preempt
        while self.waiting and not out.preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            computed_blocks, num_cached = self.kv.get_computed_blocks(req)
            remaining = req.num_tokens - num_cached
            if not self.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            if self.long_prefill_token_threshold:
                num_new = min(num_new, self.long_prefill_token_threshold)
            if not self.kv.allocate_slots(req, num_new, computed_blocks):
                if not self.running:
                    # the whole pool is free and still too small: waiting would never end
                    self._fail_unfittable(req)
                    continue
                break
            self.waiting.pop(0)
            req.num_computed_tokens = num_cached
            req.num_cached_tokens = max(req.num_cached_tokens, num_cached)
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = now
            self.running.append(req)
            self._add_to_output(out, req, num_new)
            budget -= num_new
        return out

    def _fail_unfittable(self, req: Request) -> None:
        need = self.kv.blocks_needed(req.num_tokens)
        req.error = (
            f"request {req.request_id} needs {need} KV blocks for its {req.num_tokens} tokens but the whole cache "
            f"has {self.kv.num_blocks}; raise --kv-cache-memory-bytes or shorten the prompt / max_tokens"
        )
        self.finish(req, RequestStatus.FINISHED_ERROR)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        num_new = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.long_prefill_token_threshold:
            num_new = min(num_new, self.long_prefill_token_threshold)
        if not self.enable_chunked_prefill and num_new < req.num_tokens - req.num_computed_tokens:
            return 0
        return num_new

    def _add_to_output(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        out.requests.append(req)
        out.num_new_tokens.append(num_new)
        out.num_computed_before.append(req.num_computed_tokens)
        out.block_tables.append(self.kv.block_table(req.request_id))
        req.num_computed_tokens += num_new

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: free the blocks and requeue at the front."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req)
        self._insert_waiting(req, front=True)

    def update(self, sched: SchedulerOutput, sampled_token_ids: list[Optional[int]]) -> list[Request]:
        """Append sampled tokens, apply stop conditions, free finished requests.

        Returns the requests that produced a token this step (finished ones included).
        """
        progressed = []
        for req, token_id in zip(sched.requests, sampled_token_ids):
            if token_id is None or req.is_finished:
                continue
            req.append_output_token(token_id)
            progressed.append(req)
            status = self._check_stop(req, token_id)
            if status is not None:
                self.finish(req, status)
        return progressed

    def _check_stop(self, req: Request, token_id: int) -> Optional[RequestStatus]:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if token_id == req.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Finish a request in any state and free its blocks at once."""
        if req.is_finished:
            return
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self.finished.append(req)

    def drain_finished(self) -> list[Request]:
        """Requests finished since the last call (stopped, length, aborted or failed)."""
        finished, self.finished = self.finished, []
        return finished

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                aborted.append(req)
        return aborted
