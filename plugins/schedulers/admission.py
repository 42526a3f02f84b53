"""Admitting waiting requests, mixed into :class:`~pagoda.plugins.schedulers.base.TokenBudgetScheduler`.

Each step, after running and swapped requests have their budget, waiting ones start in the order
:meth:`~pagoda.plugins.schedulers.base.TokenBudgetScheduler.order_waiting` gives, while the budget,
``max_num_seqs`` and the KV pool allow: a prefix-cache hit is shared, not recomputed, and a sequence
of an ``n > 1`` request shares the prompt blocks its sibling (the prompt leader) computed.
"""

from __future__ import annotations

import time
from typing import Optional

from pagoda.sequence import Sequence, SequenceStatus
from pagoda.step import SchedulerOutput


class WaitingAdmission:
    """The waiting queue's side of the scheduler step (private helpers, not extension points); the
    scheduler owns the state they use (``waiting``, ``running``, ``kv``, ``_prompt_leaders``)."""

    def _reorder_waiting(self) -> None:
        ordered = self.order_waiting(self.waiting)
        if ordered is self.waiting:
            return
        ordered = list(ordered)
        if len(ordered) != len(self.waiting) or set(map(id, ordered)) != set(map(id, self.waiting)):
            raise RuntimeError(
                f"{type(self).__name__}.order_waiting returned {len(ordered)} requests that are not a reordering "
                f"of the {len(self.waiting)} waiting ones; return the same requests, reordered")
        self.waiting = ordered

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        now = time.monotonic()
        idx = 0
        while idx < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[idx]
            if not self.may_admit(req):
                break
            leader = self._prompt_leader(req)
            if leader is not None and leader.num_computed_tokens < req.num_prompt_tokens - 1:
                idx += 1  # its sibling is still computing the shared prompt: join once that is done
                continue
            if leader is not None:
                num_new = self._fork_from(leader, req)
                if num_new == 0:
                    break
            else:
                computed_blocks, num_cached = self.kv.get_computed_blocks(req)
                num_new = self._num_new_tokens(req, budget, num_cached)
                if num_new == 0:
                    break
                if not self.kv.allocate_slots(req, num_new, computed_blocks):
                    if not self.running:
                        # the whole pool is free and still too small: waiting would never end
                        self._fail_unfittable(req)
                        continue
                    break
                req.num_computed_tokens = num_cached
                req.num_cached_tokens = max(req.num_cached_tokens, num_cached)
                if req.sampling_params.n > 1 and req.num_output_tokens == 0:
                    self._prompt_leaders.setdefault(req.parent_id, req)
            self.waiting.pop(idx)
            req.status = SequenceStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = now
            self._insert_running(req)
            self._add_to_output(out, req, num_new)
            budget -= num_new

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

    def _fork_from(self, leader: Sequence, req: Sequence) -> int:
        """Share the leader's prompt blocks; compute only the last prompt token (for this sequence's
        own first sample). Returns the tokens scheduled, 0 if the pool is short."""
        num_shared = req.num_prompt_tokens - 1
        self.kv.fork(leader, req, num_shared)
        req.num_computed_tokens = num_shared
        if not self.kv.allocate_slots(req, 1):
            self.kv.free(req)
            req.num_computed_tokens = 0
            return 0
        return 1
