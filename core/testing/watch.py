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

    def __init__(self, scheduler, kv, num_blocks: int, where: Where, urgency=None) -> None:
        self.scheduler, self.kv, self.num_blocks, self.where = scheduler, kv, num_blocks, where
        self.urgency = urgency  # the order the policy promises (check_scheduler's ``urgency``), or None
        self.is_in_arrivals = False  # inside the policy's preempt_for_arrivals
        self.preempted: set[str] = set()  # request ids passed to preempt() in the current schedule()
        self.running_before: list[Sequence] = []
        self.waiting_keys: dict[str, object] = {}  # request id -> its waiting key when it joined the queue
        self.is_watching_preempt = _wrap(scheduler, "preempt", self._preempt)
        _wrap(scheduler.policy, "choose_victim", self._choose_victim)
        _wrap(scheduler.policy, "preempt_for_arrivals", self._preempt_for_arrivals)
        for hook in GUARDED_HOOKS:  # after the two above, so that the guard sees the whole call
            _wrap(scheduler.policy, hook, self._guard(hook))
        _wrap(kv, "free", self._free)

    def _queues(self) -> dict[str, str]:
        s = self.scheduler
        return {r.request_id: name for name, queue in (("waiting", s.waiting), ("running", s.running),
                                                       ("swapped", s.swapped)) for r in queue}

    def _guard(self, hook: str):
        """A check around the policy's ``hook``: no request changes queue inside it except through preempt()."""

        def check(original, *args):
            before = self._queues()
            result = original(*args)
            after = self._queues()
            for rid, queue in before.items():
                if after.get(rid) != queue and rid not in self.preempted:
                    raise self.where.fail(
                        f"schedule(), the policy's {hook}()", f"{rid} moved from the {queue} queue to "
                        f"{'the ' + after[rid] + ' queue' if rid in after else 'no queue'} inside {hook}(), without "
                        "a call of preempt()", "a policy reads the scheduler's queues and never changes them; a "
                        "running request leaves the running queue only through self.scheduler.preempt(request, out)",
                        f"the policy's {hook}() (a request moved by hand)")
            return result

        return check

    def _preempt_for_arrivals(self, preempt_for_arrivals, out):
        self.is_in_arrivals = True
        try:
            return preempt_for_arrivals(out)
        finally:
            self.is_in_arrivals = False

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
        if self.urgency is not None:
            least = max(offered, key=self.urgency)
            if self.urgency(victim) < self.urgency(least):
                raise self.where.fail(
                    "schedule(), its call of choose_victim()",
                    f"choose_victim returned {victim.request_id} (urgency {self.urgency(victim)!r}, priority "
                    f"{victim.priority}) while {least.request_id} (urgency {self.urgency(least)!r}, priority "
                    f"{least.priority}) is less urgent, of candidates {[c.request_id for c in offered]}",
                    "the victim is a least urgent candidate, by the urgency the policy promises (read "
                    "request.priority, the priority the engine resolved; priority 0 is the most urgent)",
                    "the policy's choose_victim()")
        return victim

    def _preempt(self, preempt, request, out):
        self.preempted.add(request.request_id)
        if self.urgency is not None and self.is_in_arrivals:
            waiting = [r for r in self.scheduler.waiting if not self.scheduler.is_busy(r)]
            head = min(waiting, key=self.urgency, default=None)
            if head is None or not self.urgency(request) > self.urgency(head):
                what = (f"no request waits" if head is None else f"the most urgent waiting request is "
                        f"{head.request_id} (urgency {self.urgency(head)!r}, priority {head.priority})")
                raise self.where.fail(
                    "schedule(), the policy's preempt_for_arrivals()",
                    f"it preempted {request.request_id} (urgency {self.urgency(request)!r}, priority "
                    f"{request.priority}), but {what}",
                    "a request is preempted for arrivals only in favour of a more urgent waiting one, by the "
                    "urgency the policy promises (read request.priority)", "the policy's preempt_for_arrivals()")
        return preempt(request, out)

    def _free(self, free, request):
        rid = request if isinstance(request, str) else request.request_id
        held, before = self.kv.block_table(rid), self.kv.num_free_blocks
        s = self.scheduler
        others = {b for r in (*s.running, *s.waiting, *s.swapped) if r.request_id != rid and not r.is_finished
                  for b in self.kv.block_table(r.request_id)}
        exclusive = set(held) - others
        free(request)
        gained = self.kv.num_free_blocks - before
        if gained < len(exclusive) and count_disagreement(self.kv):
            raise self.where.fail(
                f"the KV allocator's free({rid!r})",
                f"free({rid!r}) gave back {gained} blocks of the {len(exclusive)} it held alone, by num_free_blocks; "
                f"{count_disagreement(self.kv)}", COUNT_RULE, COUNT_SUSPECT)
        if gained < len(exclusive):
            raise self.where.fail(
                f"the KV allocator's free({rid!r})",
                f"free({rid!r}) gave back {gained} blocks, but {len(exclusive)} of its {len(set(held))} blocks were "
                f"held by no other sequence ({before} -> {self.kv.num_free_blocks} of {self.num_blocks} free): a "
                "block is lost (a reference count dropped twice, below zero)",
                "free() gives back every block no other sequence holds; a shared block's reference count drops by "
                "one per holder", "the KV allocator's free()")
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
        if self.urgency is not None:
            waiting = self.scheduler.waiting
            for ahead, behind in zip(waiting, waiting[1:]):
                if self.urgency(behind) < self.urgency(ahead):
                    raise self.where.fail(
                        "schedule()", f"the waiting queue holds {ahead.request_id} (urgency "
                        f"{self.urgency(ahead)!r}, priority {ahead.priority}) ahead of the more urgent "
                        f"{behind.request_id} (urgency {self.urgency(behind)!r}, priority {behind.priority})",
                        "waiting requests are queued in the urgency order the policy promises (read "
                        "request.priority; priority 0 is the most urgent)",
                        "the policy's waiting_key() or order_waiting()")

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


# a free count that disagrees with the allocator's usage: the rule, and the methods at fault
COUNT_RULE = ("num_free_blocks counts every block no sequence holds (blocks that still cache a prefix included: they "
              "are taken again when the pool needs them), and usage is the fraction held: the two agree")
COUNT_SUSPECT = "the KV allocator's num_free_blocks() (or its usage, whichever miscounts)"


def count_disagreement(kv) -> str:
    """What is wrong when the allocator's two public counts of its pool, ``num_free_blocks`` and ``usage``,
    disagree (a free count that leaves out cached blocks, say), else ''."""
    held = round(kv.usage * kv.num_blocks)
    if kv.num_blocks - held == kv.num_free_blocks:
        return ""
    return (f"num_free_blocks says {kv.num_free_blocks} of {kv.num_blocks} blocks are free, but usage "
            f"{kv.usage:.3f} says {held} are held, so {kv.num_blocks - held} are free")


# the policy's hooks called once per step or per request (the key hooks are called too often to guard)
GUARDED_HOOKS = ("order_waiting", "order_running", "choose_victim", "may_admit", "may_swap_in",
                 "preempt_for_arrivals", "on_step_start", "on_request_added", "on_request_scheduled",
                 "on_step_executed", "on_request_finished")


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
