"""Priority scheduling: lower ``priority`` first, ties by arrival then request id (vLLM's convention)."""

from __future__ import annotations

import bisect

from pagoda.plugins.schedulers.base import TokenBudgetScheduler
from pagoda.request import Request


def _key(req: Request) -> tuple:
    return (req.priority, req.arrival_time, req.request_id)


class PriorityScheduler(TokenBudgetScheduler):
    """Waiting requests ordered by priority; the lowest-priority, latest-arrived running one is preempted."""

    def _insert_waiting(self, request: Request, front: bool = False) -> None:
        bisect.insort(self.waiting, request, key=_key)

    def _pick_victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=_key)
