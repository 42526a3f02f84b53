"""The scheduler check's watch over a scheduler, its policy and its allocator while a request stream runs: each
call of the policy's ``choose_victim``, the scheduler's ``preempt`` and the allocator's ``free`` is checked as it happens, and the waiting keys and
the block counts between operations (see :func:`pagoda.testing.check_scheduler`)."""

from __future__ import annotations

from pagoda.sequence import Sequence
from pagoda.step import SchedulerOutput
from pagoda.testing.contract import Where


class PolicyWatch:
    """Wraps the policy's ``choose_victim``, the scheduler's ``preempt`` and the allocator's ``free`` (instance
    attributes over the methods, where the component allows it) to check each call as it happens, and
    checks the waiting keys and the allocator's block count between operations."""

    def __init__(self, scheduler, kv, num_blocks: int, where: Where) -> None:
        self.scheduler, self.kv, self.num_blocks, self.where = scheduler, kv, num_blocks, where
        self.preempted: set[str] = set()  # request ids passed to preempt() in the current schedule()
        self.running_before: list[Sequence] = []
        self.waiting_keys: dict[str, object] = {}  # request id -> its waiting key when it joined the queue
        self.is_watching_preempt = _wrap(scheduler, "preempt", self._preempt)
        _wrap(scheduler.policy, "choose_victim", self._choose_victim)
        _wrap(kv, "free", self._free)

    def _choose_victim(self, choose_victim, candidates):
        offered = list(candidates)
        victim = choose_victim(candidates)
        if not any(victim is c for c in offered):
            name = getattr(victim, "request_id", repr(victim))
            raise self.where.fail("schedule(), its call of choose_victim()",
                                  f"choose_victim returned {name}, which is not one of its {len(offered)} candidates "
                                  f"{[c.request_id for c in offered]}",
                                  "the victim is one of the candidates (running requests not yet scheduled this step)",
                                  "the policy's choose_victim()")
        return victim

    def _preempt(self, preempt, request, out):
        self.preempted.add(request.request_id)
        return preempt(request, out)

    def _free(self, free, request):
        rid = request if isinstance(request, str) else request.request_id
        held, before = self.kv.block_table(rid), self.kv.num_free_blocks
        free(request)
        gained = self.kv.num_free_blocks - before
        if gained > len(set(held)):
            what = "which held no blocks (already freed)" if not held else f"which held {len(set(held))} blocks"
            raise self.where.fail(
                f"the KV allocator's free({rid!r})",
                f"a double free: free({rid!r}), {what}, put {gained} blocks back in the free pool "
                f"({before} -> {self.kv.num_free_blocks} of {self.num_blocks} free)",
                "free() gives back only the blocks the sequence holds; freeing a sequence again changes nothing",
                "the KV allocator's free()")

    def before_schedule(self) -> None:
        self.preempted.clear()
        self.running_before = list(self.scheduler.running)

    def after_schedule(self, sched: SchedulerOutput) -> None:
        running = {id(r) for r in self.scheduler.running}
        by_preempt = self.preempted if self.is_watching_preempt else {r.request_id for r in sched.preempted}
        failed = {r.request_id for r, _ in sched.failed}
        for req in self.running_before:
            if id(req) in running or req.is_finished or req.request_id in by_preempt or req.request_id in failed:
                continue
            raise self.where.fail(
                "schedule()", f"{req.request_id} left the running queue (now {req.status.value}) without a call "
                "of preempt()", "a running request is preempted only through preempt(), which frees or swaps "
                "its blocks and records it in the step's output",
                "the policy's preempt_for_arrivals() (a request moved by hand)")
        self.check_waiting_keys(by_preempt | {r.request_id for r in sched.requests})
        self.check_books((), "schedule()")

    def check_waiting_keys(self, left_queue: set[str]) -> None:
        """Each waiting request's key against the key it had when it joined the queue (``left_queue``: ids
        that left the waiting queue since the last look, whatever the queue holds now)."""
        waiting_key = self.scheduler.policy.waiting_key
        keys: dict[str, object] = {}
        for req in self.scheduler.waiting:
            key = waiting_key(req)
            joined = self.waiting_keys.get(req.request_id, key) if req.request_id not in left_queue else key
            if joined != key:
                raise self.where.fail(
                    "waiting_key()", f"waiting_key({req.request_id}) was {joined!r} when it joined the waiting "
                    f"queue and is {key!r} now, while it still waits",
                    "a key does not change while its request is queued (an order that changes as requests wait "
                    "belongs in order_waiting())", "the policy's waiting_key()")
            keys[req.request_id] = key
        self.waiting_keys = keys

    def check_books(self, requests, operation: str) -> None:
        """No block is both free and held: the free count plus the blocks the live sequences hold stays
        within the pool."""
        live = [r for r in (*self.scheduler.running, *self.scheduler.waiting, *requests) if not r.is_finished]
        held = {b for r in {r.request_id: r for r in live} for b in self.kv.block_table(r)}
        if self.kv.num_free_blocks + len(held) > self.num_blocks:
            raise self.where.fail(
                operation, f"{self.kv.num_free_blocks} blocks are reported free while live sequences hold "
                f"{len(held)} others, of {self.num_blocks}: a block is free and held at once",
                "a block is either free or held (a double free puts a held block back in the pool)",
                "the KV allocator's free() or the scheduler's finish()/preempt()")


    def check_finished_hold_nothing(self, finished: list[Sequence]) -> None:
        for req in finished:
            held = self.kv.block_table(req.request_id)
            if held:
                raise self.where.fail(
                    "update()", f"{req.request_id} finished ({req.status.value}) in this step but still holds "
                    f"blocks {held}", "a finished sequence gives back its blocks at once",
                    "the scheduler's finish() (no free() of the sequence) or the KV allocator's free()")


def _wrap(component, method: str, check) -> bool:
    """Put ``check(original, *args)`` in front of ``component.method``; False if it has no such method or
    refuses instance attributes."""
    original = getattr(component, method, None)
    if original is None:
        return False
    try:
        setattr(component, method, lambda *args: check(original, *args))
    except (AttributeError, TypeError):
        return False
    return True
