"""``fair``: the engine shared between tenants by the service each has received.

Each tenant (``Sequence.tenant``: who sent the request, as the server identifies it; None is one tenant of its
own) has a virtual token counter: the prompt tokens computed for it plus twice the tokens it was given, divided
by its weight (the option ``tenant_weights``, 1 by default). This is the virtual-token-counter policy of
Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024), on the token-budget scheduler:

- waiting requests start in the order of their tenant's counter, lowest first (arrival order within a tenant);
- a tenant that comes back after a pause starts from the lowest counter among the tenants being served, not
  from the counter it had when it left, so a pause is not saved up to flood the engine later;
- running sequences get each step's budget in the same order, so when the budget is short the tenant served
  least goes first;
- a tenant kept waiting while the batch has no seat or block left for it takes a seat from the tenant holding
  the most seats beyond its weighted share (``max_num_seqs`` split over the tenants with work), newest
  sequence first. No sequence is preempted for a tenant that already holds its share;
- while a light tenant is active beside others (one with at most ``step_seqs`` sequences
  or a quarter of the largest tenant's, or one that had work within the last ``IDLE_GRACE_STEPS`` steps), the
  light tenants run all their sequences and the heavy ones share what is left of ``step_seqs`` by weight,
  each at least one sequence a step. A step's time grows with the sequences it runs, so this keeps a tenant
  with many sequences from slowing a light tenant's tokens; its sequences beyond its part keep their KV blocks
  and wait a step (``0``: no bound). Heavy tenants alone together are not bounded: they share the batch by
  the counters and the seats above;
- otherwise (one tenant alone, or heavy tenants alone together) a step is bounded by time when
  ``step_ms`` is set: it runs as many running sequences as fit in that many milliseconds
  at the seconds per sequence measured over recent decode steps (``RunnerOutput.execute_seconds``), shared by
  weight. A step that has started cannot be cut short, so a tenant that arrives while another runs alone waits
  for the rest of that step before its prompt is computed: this bounds that wait. Requests still start as
  room allows; the bound rotates the running sequences, least recently run first, so none stalls.

With one tenant and no time bound it schedules as ``fcfs`` does.

Options (``--scheduler-options '{"step_seqs": 4, "tenant_weights": {"alice": 2}}'``; the older flags
``--tenant-weights``, ``--fair-step-seqs`` and ``--fair-step-ms`` set the same three):

- ``tenant_weights``: ``{tenant: weight}``, each weight a positive number (default: every tenant weighs 1);
- ``step_seqs``: the sequence bound above, ``0`` for none (default 2);
- ``step_ms``: the time bound above in milliseconds, ``0`` for none (default 250).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Mapping, Optional

from pagoda.scheduling import Scheduler, SchedulingPolicy
from pagoda.sequence import Sequence
from pagoda.step import RunnerOutput, SchedulerOutput

# the cost of a token, in counter units: an output token costs more than a prompt token (it takes a whole step)
PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0
# steps a tenant still counts as active after its last sequence ended: a client that sends its next request as
# soon as one is answered finds the steps still bounded, not one full step of the other tenants' sequences
IDLE_GRACE_STEPS = 16
# a tenant with at most 1/LIGHT_SHARE of the sequences of the largest tenant counts as light for the step bound
LIGHT_SHARE = 4
# the weight of the newest decode step in the running estimate of seconds per sequence
STEP_TIME_SMOOTHING = 0.3
# step_seqs by default: on the CPU measured (docs/fairness.md) a decode step of four sequences of the default
# model took about twice the time of a step of one, and at times more; a step of two stays well within twice, so
# a light tenant's tokens stay within 2x of their unloaded time beside a flooding tenant
STEP_SEQS = 2
# step_ms by default: a tenant arriving while another runs alone waits for the rest of that tenant's step; a
# first token unloaded took 120-300 ms on the CPU measured (docs/fairness.md), so a step of at most 250 ms keeps
# that wait (half a step on average) within the unloaded time; what it costs the lone tenant's throughput grows as
# its steps get slower (at least step_seqs sequences run), measured in docs/fairness.md
STEP_MS = 250.0


def _check_weights(tenant_weights: Optional[Mapping[str, float]]) -> dict[Optional[str], float]:
    if tenant_weights is None:
        return {}
    if not isinstance(tenant_weights, Mapping):
        raise ValueError(f"option tenant_weights must map tenant names to weights (e.g. {{\"alice\": 2}}), got "
                         f"{tenant_weights!r}")
    for name, weight in tenant_weights.items():
        if (not isinstance(weight, (int, float)) or isinstance(weight, bool) or not weight > 0
                or math.isinf(weight)):
            raise ValueError(f"option tenant_weights: the weight of {name!r} is {weight!r}; give a positive number")
    return {name: float(weight) for name, weight in tenant_weights.items()}


def _check_bound(name: str, value, kind: type) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)) \
            or not value >= 0 or math.isinf(value):
        raise ValueError(f"option {name} is {value!r}; give {'an integer' if kind is int else 'a number'} >= 0 "
                         "(0: no such bound)")


class FairPolicy(SchedulingPolicy):
    """Virtual-token-counter fairness between tenants (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, tenant_weights: Optional[Mapping[str, float]] = None,
                 step_seqs: int = STEP_SEQS, step_ms: float = STEP_MS) -> None:
        super().__init__(scheduler)
        self.weights = _check_weights(tenant_weights)
        _check_bound("step_seqs", step_seqs, int)
        _check_bound("step_ms", step_ms, float)
        # counters of tenants seen (a tenant with no work left keeps its entry until it comes back)
        self.service: dict[Optional[str], float] = {}
        # live sequences (waiting, running or swapped) per tenant
        self._live: Counter = Counter()
        self.step_seqs = int(step_seqs)
        # tenants whose last sequence ended recently -> steps they still count as active
        self._idle_grace: dict[Optional[str], int] = {}
        # this step's sequences per tenant while the step bound is in force (None: no bound this step)
        self._step_seats: Optional[dict[Optional[str], int]] = None
        # whether this step's seats come from the time bound (it rotates running sequences; starts are not bound)
        self._step_is_timed = False
        # sequences per tenant scheduled in the step being built
        self._scheduled_per_tenant: Counter = Counter()
        # the time bound: milliseconds a step may take (0: none), and the measured seconds per decoding sequence
        self.step_ms = float(step_ms)
        self._seconds_per_seq: Optional[float] = None
        # sequences run so far (over all steps), and request id -> the count when it last ran: the bounds run
        # the least recently run first
        self._num_runs = 0
        self._last_run: dict[str, int] = {}

    def weight(self, tenant: Optional[str]) -> float:
        return self.weights.get(tenant, 1.0)

    # ---- accounting --------------------------------------------------------------------------------

    def on_request_added(self, request: Sequence) -> None:
        tenant = request.tenant
        if not self._live[tenant]:
            # back after a pause (or new): start level with the least-served tenant that has work now
            active = [self.service[t] for t, n in self._live.items() if n and t != tenant]
            floor = min(active) if active else 0.0
            self.service[tenant] = max(self.service.get(tenant, 0.0), floor)
        self._live[tenant] += 1

    def on_request_finished(self, request: Sequence) -> None:
        self._live[request.tenant] -= 1
        if not self._live[request.tenant]:
            del self._live[request.tenant]
            self._idle_grace[request.tenant] = IDLE_GRACE_STEPS
        self._last_run.pop(request.request_id, None)

    def on_step_executed(self, sched: SchedulerOutput, result: RunnerOutput) -> None:
        service = self.service
        for req, start, num_new, num_drafts, token_ids in zip(
                sched.requests, sched.num_computed_before, sched.num_new_tokens, sched.num_draft_slots,
                result.sampled_token_ids):
            # prompt positions computed this step, and the tokens the step gave the request
            num_prompt = max(0, min(start + num_new - num_drafts, req.num_prompt_tokens) - start)
            cost = PROMPT_TOKEN_COST * num_prompt + OUTPUT_TOKEN_COST * len(token_ids)
            if cost:
                service[req.tenant] = service.get(req.tenant, 0.0) + cost / self.weight(req.tenant)
        # a new ticket per sequence run, handed out in the order of the old ones: the bounds run the lowest
        # tickets first, so the sequences of a tenant take turns as in a queue (a round robin)
        last_run = self._last_run
        for req in sorted(sched.requests, key=lambda r: last_run.get(r.request_id, 0)):
            self._num_runs += 1
            last_run[req.request_id] = self._num_runs
        self._measure_step(sched, result)

    def _measure_step(self, sched: SchedulerOutput, result: RunnerOutput) -> None:
        """Fold a decode step's measured time into the estimate of seconds per sequence (prefill chunks cost by
        their tokens, not their sequences: steps with one are not counted)."""
        seconds = result.execute_seconds
        num_seqs = len(sched.requests)
        if seconds is None or not num_seqs or sched.has_block_moves:
            return
        if any(n - d != 1 for n, d in zip(sched.num_new_tokens, sched.num_draft_slots)):
            return
        per_seq = seconds / num_seqs
        old = self._seconds_per_seq
        self._seconds_per_seq = per_seq if old is None else old + STEP_TIME_SMOOTHING * (per_seq - old)

    def _counter(self, req: Sequence) -> float:
        return self.service.get(req.tenant, 0.0)

    # ---- policy ------------------------------------------------------------------------------------

    def order_waiting(self, waiting: list[Sequence]) -> list[Sequence]:
        if len(self._live) < 2:
            return waiting
        # least served first; on a tie the tenant holding fewer seats; work preempted in this step last (it may
        # not start again before the step is committed). sorted() is stable: within a tenant the queue's own
        # order (preempted work first, then arrival) stays
        seats = Counter(r.tenant for r in self.scheduler.running)
        preempted = self.scheduler.was_preempted_in_this_step
        return sorted(waiting, key=lambda r: (preempted(r), self._counter(r), seats[r.tenant]))

    def order_running(self, running: list[Sequence]) -> list[Sequence]:
        order = running
        if len(self._live) >= 2:
            order = sorted(order, key=self._counter)
        seats = self._step_seats
        if seats is None:
            return order
        # each tenant's least recently run sequences, as many as its part of the step, kept in running order
        last_run = self._last_run
        taken: Counter = Counter()
        chosen = set()
        for req in sorted(order, key=lambda r: last_run.get(r.request_id, 0)):
            if taken[req.tenant] < seats.get(req.tenant, 0):
                taken[req.tenant] += 1
                chosen.add(req.request_id)
        return [req for req in order if req.request_id in chosen]

    def on_step_start(self) -> None:
        self._scheduled_per_tenant = Counter()
        self._step_is_timed = False
        self._step_seats = self._split_step() if self.step_seqs else None
        if self._step_seats is None and self.step_ms:
            self._step_seats = self._split_step_by_time()
            self._step_is_timed = self._step_seats is not None
        for tenant in list(self._idle_grace):
            self._idle_grace[tenant] -= 1
            if self._idle_grace[tenant] <= 0 or tenant in self._live:
                del self._idle_grace[tenant]

    def on_request_scheduled(self, request: Sequence, num_new_tokens: int) -> None:
        self._scheduled_per_tenant[request.tenant] += 1

    def _has_seat(self, tenant: Optional[str]) -> bool:
        """Whether ``tenant`` has not yet run its part of this step's bound."""
        return self._scheduled_per_tenant[tenant] < self._step_seats.get(tenant, 0)

    def may_admit(self, request: Sequence) -> bool:
        if self._step_seats is None:
            return super().may_admit(request)
        # swapped-out sequences come back first, except those the bound holds back (their tenant ran its part):
        # they do not hold up another tenant's start
        if any(r.tenant == request.tenant or self._has_seat(r.tenant) for r in self.scheduler.swapped):
            return False
        if self._step_is_timed:
            return True
        # a tenant that runs its part of the step already starts nothing more in it
        return self._has_seat(request.tenant)

    def may_swap_in(self, request: Sequence) -> bool:
        # a swapped-out sequence comes back only within its tenant's part of a bounded step
        return self._step_seats is None or self._has_seat(request.tenant)

    def _demand(self) -> Counter:
        """Sequences per tenant with work: running, swapped out and waiting."""
        scheduler = self.scheduler
        demand = Counter(r.tenant for r in scheduler.running)
        demand.update(r.tenant for r in scheduler.swapped)
        demand.update(r.tenant for r in scheduler.waiting)
        return demand

    def _split_step(self) -> Optional[dict[Optional[str], int]]:
        """This step's sequences per tenant with work, or None for no bound. A light tenant (at most
        ``step_seqs`` sequences, or at most a quarter of the largest tenant's) runs all of its; the heavy
        tenants share what is left of ``step_seqs`` by weight, each at least one. No bound unless a light
        tenant is active beside the others (with work, or within ``IDLE_GRACE_STEPS`` steps of its last): heavy
        tenants alone together share seats by the counters, each step as large as the batch."""
        if len(self._live.keys() | self._idle_grace.keys()) < 2:
            return None
        demand = self._demand()
        if not demand:
            return None
        largest = max(demand.values())
        seats = {t: n for t, n in demand.items() if n <= self.step_seqs or LIGHT_SHARE * n <= largest}
        if not seats and not any(t not in demand for t in self._idle_grace):
            return None
        heavy = [t for t in demand if t not in seats]
        if heavy:
            capacity = max(0, self.step_seqs - sum(seats.values()))
            seats.update(self._share(heavy, capacity))
        return seats

    def _split_step_by_time(self) -> Optional[dict[Optional[str], int]]:
        """The time bound: as many running sequences as fit in ``step_ms`` at the measured seconds per
        sequence (at least ``step_seqs``), shared by weight; None while they all fit or nothing is measured."""
        if self._seconds_per_seq is None:
            return None
        running = Counter(r.tenant for r in self.scheduler.running)
        running.update(r.tenant for r in self.scheduler.swapped)
        capacity = max(1, self.step_seqs, int(self.step_ms / 1000 / self._seconds_per_seq))
        if sum(running.values()) <= capacity:
            return None
        return self._share(list(running), capacity)

    def _share(self, tenants: list[Optional[str]], capacity: int) -> dict[Optional[str], int]:
        """``capacity`` sequences split between ``tenants`` by weight, each at least one."""
        total_weight = sum(self.weight(t) for t in tenants)
        return {t: max(1, int(capacity * self.weight(t) / total_weight)) for t in tenants}

    def preempt_for_arrivals(self, out: SchedulerOutput) -> None:
        scheduler = self.scheduler
        if len(self._live) < 2 or not scheduler.waiting or not scheduler.running:
            return
        head = next((r for r in self.order_waiting(scheduler.waiting) if not scheduler.is_busy(r)), None)
        if head is None or scheduler.was_preempted_in_this_step(head) or not self.may_admit(head):
            return
        tenant = head.tenant
        seats = Counter(r.tenant for r in scheduler.running)
        total_weight = sum(self.weight(t) for t in self._live)
        share = {t: scheduler.max_num_seqs * self.weight(t) / total_weight for t in self._live}
        if seats[tenant] >= share.get(tenant, 0.0):
            return  # it holds its share: it waits like anyone else
        while not scheduler.would_fit(head):
            over = [t for t in seats if t != tenant and seats[t] > share.get(t, 0.0)]
            if not over:
                return
            donor = max(over, key=lambda t: seats[t] - share[t])
            candidates = [r for r in scheduler.running if r.tenant == donor and not scheduler.is_busy(r)]
            if not candidates:
                return
            victim = self.choose_victim(candidates)
            scheduler.preempt(victim, out)
            seats[donor] -= 1

    def tenant_counters(self) -> dict[Optional[str], float]:
        """Each tenant's service so far, in weighted token units (for metrics and tests)."""
        return dict(self.service)
