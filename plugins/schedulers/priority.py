"""Priority scheduling: lower ``priority`` first, ties by arrival then request id (vLLM's convention)."""

from __future__ import annotations

from pagoda.scheduling import SchedulingPolicy
from pagoda.sequence import Sequence
from pagoda.step import SchedulerOutput


def priority_key(req: Sequence) -> tuple:
    return (req.priority, req.arrival_time, req.request_id)


class PriorityPolicy(SchedulingPolicy):
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
        swapped = self.scheduler.swapped
        return not swapped or priority_key(request) < priority_key(swapped[0])

    def preempt_for_arrivals(self, out: SchedulerOutput) -> None:
        scheduler = self.scheduler
        head = next((r for r in scheduler.waiting if not scheduler.is_busy(r)), None)
        if head is None or not scheduler.running:
            return
        head_key = priority_key(head)
        lower = [r for r in scheduler.running if priority_key(r) > head_key and not scheduler.is_busy(r)]
        if not lower or scheduler.would_fit(head):
            return
        # preempt only if evicting all lower-ranked work would make room; otherwise it gains nothing
        reclaimable = sum(scheduler.kv.num_exclusive_blocks(r.request_id) for r in lower)
        need = scheduler.num_blocks_to_start(head)
        seats = scheduler.max_num_seqs - len(scheduler.running) + len(lower)
        if need > scheduler.kv.num_free_blocks + reclaimable or seats < 1:
            return
        for victim in reversed(lower):  # lowest rank first
            scheduler.preempt(victim, out)
            if scheduler.would_fit(head):
                return
