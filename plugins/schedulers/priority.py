"""Priority scheduling: lower ``priority`` first, ties by arrival then request id (vLLM's convention)."""

from __future__ import annotations

from pagoda.plugins.schedulers.base import TokenBudgetScheduler
from pagoda.sequence import Sequence
from pagoda.step import SchedulerOutput


def priority_key(req: Sequence) -> tuple:
    return (req.priority, req.arrival_time, req.request_id)


class PriorityScheduler(TokenBudgetScheduler):
    """Every queue is kept in priority order, so the most important work is scheduled first.

    When blocks run out, the lowest-priority, latest-arrived running request is
    preempted; a waiting request that outranks running work and cannot fit
    preempts the lowest-ranked running requests until it can.
    """

    def waiting_key(self, request: Sequence) -> tuple:
        return priority_key(request)

    def running_key(self, request: Sequence) -> tuple:
        # strictly by priority: decodes of low-priority work must not pin blocks a higher one needs
        return priority_key(request)

    def choose_victim(self, candidates: list[Sequence]) -> Sequence:
        return max(candidates, key=priority_key)

    def may_admit(self, request: Sequence) -> bool:
        return not self.swapped or priority_key(request) < priority_key(self.swapped[0])

    def preempt_for_arrivals(self, out: SchedulerOutput) -> None:
        head = next((r for r in self.waiting if not self.is_busy(r)), None)
        if head is None or not self.running:
            return
        head_key = priority_key(head)
        lower = [r for r in self.running if priority_key(r) > head_key and not self.is_busy(r)]
        if not lower or self._fits(head):
            return
        # preempt only if evicting all lower-ranked work would make room; otherwise it gains nothing
        reclaimable = sum(self.kv.num_exclusive_blocks(r.request_id) for r in lower)
        need = self._blocks_for_first_chunk(head)
        seats = self.max_num_seqs - len(self.running) + len(lower)
        if need > self.kv.num_free_blocks + reclaimable or seats < 1:
            return
        for victim in reversed(lower):  # lowest rank first
            self.preempt(victim, out)
            if self._fits(head):
                return

    def _fits(self, req: Sequence) -> bool:
        return len(self.running) < self.max_num_seqs and self._blocks_for_first_chunk(req) <= self.kv.num_free_blocks

    def _blocks_for_first_chunk(self, req: Sequence) -> int:
        computed_blocks, num_cached = self.kv.get_computed_blocks(req)
        num_new = self._num_new_tokens(req, self.max_num_batched_tokens, num_cached)
        return self.kv.num_blocks_to_take(req, num_new, computed_blocks)
