"""Longest prefix match first: the waiting request with the most prompt tokens already in the
prefix cache starts first.

Requests that share a prefix (a system prompt, a few-shot preamble, a long document asked several
questions) then run while their prefix is still cached, instead of being interleaved with other
groups that evict it. Only public pagoda API is used: the KV allocator's ``get_computed_blocks``
(what admission would reuse now) and the scheduling policy hooks of ``pagoda.scheduling.SchedulingPolicy``:
``order_waiting``, called once per step because the answer changes as the cache fills and evicts, and
``on_request_added`` / ``on_request_finished`` to know how long each request has waited.

Starvation guard: a request that matches nothing could wait forever behind a stream of matching
ones. A request that has waited ``max_wait_steps`` scheduler steps, and a preempted request, goes
first, in arrival order, whatever it matches.

Options (``--scheduler-options '{"lookahead": 64, "max_wait_steps": 128}'``): ``lookahead``, how many requests
at the head of the queue are reordered (each costs a prefix-cache lookup per step; default 128);
``max_wait_steps``, steps after which a waiting request goes first regardless (default 256).
"""

from __future__ import annotations

from pagoda.scheduling import Scheduler, SchedulingPolicy
from pagoda.sequence import Sequence


class PrefixAwareScheduler(SchedulingPolicy):
    """The waiting queue ordered by cached prefix length, each step (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, lookahead: int = 128, max_wait_steps: int = 256) -> None:
        super().__init__(scheduler)
        for name, value in (("lookahead", lookahead), ("max_wait_steps", max_wait_steps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"option {name} is {value!r}; give an integer >= 1")
        self.lookahead = lookahead
        self.max_wait_steps = max_wait_steps
        self.num_steps = 0
        # request id -> the step count when it was added; dropped when it finishes
        self._added_at: dict[str, int] = {}

    def on_request_added(self, request: Sequence) -> None:
        self._added_at[request.request_id] = self.num_steps

    def on_request_finished(self, request: Sequence) -> None:
        self._added_at.pop(request.request_id, None)

    def order_waiting(self, waiting: list[Sequence]) -> list[Sequence]:
        self.num_steps += 1
        if len(waiting) < 2:
            return waiting
        head = waiting[:self.lookahead]
        urgent: list[Sequence] = []
        ranked: list[tuple[int, int, Sequence]] = []
        for position, req in enumerate(head):
            waited = self.num_steps - self._added_at.get(req.request_id, self.num_steps)
            if req.num_preemptions or waited >= self.max_wait_steps:
                urgent.append(req)  # already in arrival order: the queue keeps it
                continue
            _, num_cached = self.scheduler.kv.get_computed_blocks(req)
            ranked.append((-num_cached, position, req))
        ranked.sort(key=lambda item: item[:2])  # most cached first, ties keep queue order
        return urgent + [req for _, _, req in ranked] + waiting[self.lookahead:]
