"""``fair``: the engine shared between tenants by the service each has received.

Each tenant (``Sequence.tenant``: who sent the request, as the server identifies it; None is one tenant of its
own) has a virtual token counter: the prompt tokens computed for it plus twice the tokens it was given, divided
by its weight (``SchedulerConfig.tenant_weights``, 1 by default). This is the virtual-token-counter policy of
Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024), on the token-budget scheduler:

- waiting requests start in the order of their tenant's counter, lowest first (arrival order within a tenant);
- a tenant that comes back after a pause starts from the lowest counter among the tenants being served, not
  from the counter it had when it left, so a pause is not saved up to flood the engine later;
- running sequences get each step's budget in the same order, so when the budget is short the tenant served
  least goes first;
- a tenant kept waiting while the batch has no seat or block left for it takes a seat from the tenant holding
  the most seats beyond its weighted share (``max_num_seqs`` split over the tenants with work), newest
  sequence first. No sequence is preempted for a tenant that already holds its share;
- while a light tenant is active beside others (one with at most ``SchedulerConfig.fair_step_seqs`` sequences
  or a quarter of the largest tenant's, or one that had work within the last ``IDLE_GRACE_STEPS`` steps), the
  light tenants run all their sequences and the heavy ones share what is left of ``fair_step_seqs`` by weight,
  each at least one sequence a step. A step's time grows with the sequences it runs, so this keeps a tenant
  with many sequences from slowing a light tenant's tokens; its sequences beyond its part keep their KV blocks
  and wait a step (``0``: no bound). Heavy tenants alone together are not bounded: they share the batch by
  the counters and the seats above.

With one tenant it schedules as ``fcfs`` does.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.plugins.schedulers.base import TokenBudgetScheduler
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


class FairScheduler(TokenBudgetScheduler):
    """Virtual-token-counter fairness between tenants (see the module docstring)."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_manager) -> None:
        super().__init__(scheduler_config, cache_config, kv_manager)
        self.weights: dict[Optional[str], float] = dict(scheduler_config.tenant_weights)
        # counters of tenants seen (a tenant with no work left keeps its entry until it comes back)
        self.service: dict[Optional[str], float] = {}
        # live sequences (waiting, running or swapped) per tenant
        self._live: Counter = Counter()
        self.fair_step_seqs = scheduler_config.fair_step_seqs
        # tenants whose last sequence ended recently -> steps they still count as active
        self._idle_grace: dict[Optional[str], int] = {}
        # this step's sequences per tenant while the step bound is in force (None: no bound this step)
        self._step_seats: Optional[dict[Optional[str], int]] = None

    def weight(self, tenant: Optional[str]) -> float:
        return self.weights.get(tenant, 1.0)

    # ---- accounting --------------------------------------------------------------------------------

    def add_request(self, request: Sequence) -> None:
        tenant = request.tenant
        if not self._live[tenant]:
            # back after a pause (or new): start level with the least-served tenant that has work now
            active = [self.service[t] for t, n in self._live.items() if n and t != tenant]
            floor = min(active) if active else 0.0
            self.service[tenant] = max(self.service.get(tenant, 0.0), floor)
        self._live[tenant] += 1
        super().add_request(request)

    def finish(self, req: Sequence, status) -> None:
        if not req.is_finished:
            self._live[req.tenant] -= 1
            if not self._live[req.tenant]:
                del self._live[req.tenant]
                self._idle_grace[req.tenant] = IDLE_GRACE_STEPS
        super().finish(req, status)

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Sequence]:
        service = self.service
        for req, start, num_new, num_drafts, token_ids in zip(
                sched.requests, sched.num_computed_before, sched.num_new_tokens, sched.num_draft_slots,
                result.sampled_token_ids):
            # prompt positions computed this step, and the tokens the step gave the request
            num_prompt = max(0, min(start + num_new - num_drafts, req.num_prompt_tokens) - start)
            cost = PROMPT_TOKEN_COST * num_prompt + OUTPUT_TOKEN_COST * len(token_ids)
            if cost:
                service[req.tenant] = service.get(req.tenant, 0.0) + cost / self.weight(req.tenant)
        return super().update(sched, result)

    def _counter(self, req: Sequence) -> float:
        return self.service.get(req.tenant, 0.0)

    # ---- policy ------------------------------------------------------------------------------------

    def order_waiting(self, waiting: list[Sequence]) -> list[Sequence]:
        if len(self._live) < 2:
            return waiting
        # least served first; on a tie the tenant holding fewer seats; work preempted in this step last (it may
        # not start again before the step is committed). sorted() is stable: within a tenant the queue's own
        # order (preempted work first, then arrival) stays
        seats = Counter(r.tenant for r in self.running)
        preempted = self._preempted_now
        return sorted(waiting, key=lambda r: (r.request_id in preempted, self._counter(r), seats[r.tenant]))

    def _running_order(self) -> list[Sequence]:
        order = super()._running_order()
        if len(self._live) >= 2:
            order = sorted(order, key=self._counter)
        seats = self._step_seats
        if seats is None:
            return order
        # each tenant's first sequences in running order, as many as its part of the step
        taken: Counter = Counter()
        kept = []
        for req in order:
            if taken[req.tenant] < seats.get(req.tenant, 0):
                taken[req.tenant] += 1
                kept.append(req)
        return kept

    def schedule(self) -> SchedulerOutput:
        self._step_seats = self._split_step() if self.fair_step_seqs else None
        for tenant in list(self._idle_grace):
            self._idle_grace[tenant] -= 1
            if self._idle_grace[tenant] <= 0 or tenant in self._live:
                del self._idle_grace[tenant]
        return super().schedule()

    def may_admit(self, request: Sequence) -> bool:
        if not super().may_admit(request):
            return False
        seats = self._step_seats
        if seats is None:
            return True
        # a tenant that runs its part of the step already starts nothing more in it
        tenant = request.tenant
        requests = self.requests
        num_now = sum(1 for rid in self._scheduled_now if requests[rid].tenant == tenant)
        return num_now < seats.get(tenant, 0)

    def _split_step(self) -> Optional[dict[Optional[str], int]]:
        """This step's sequences per tenant with work (running and waiting), or None for no bound. A light tenant
        (at most ``fair_step_seqs`` sequences, or at most a quarter of the largest tenant's) runs all of its; the
        heavy tenants share what is left of ``fair_step_seqs`` by weight, each at least one. No bound unless a
        light tenant is active beside the others (with work, or within ``IDLE_GRACE_STEPS`` steps of its last):
        heavy tenants alone together share seats by the counters, each step as large as the batch."""
        if len(self._live.keys() | self._idle_grace.keys()) < 2:
            return None
        demand = Counter(r.tenant for r in self.running)
        demand.update(r.tenant for r in self.waiting)
        if not demand:
            return None
        largest = max(demand.values())
        seats = {t: n for t, n in demand.items() if n <= self.fair_step_seqs or LIGHT_SHARE * n <= largest}
        if not seats and not any(t not in demand for t in self._idle_grace):
            return None
        heavy = [t for t in demand if t not in seats]
        if heavy:
            capacity = max(0, self.fair_step_seqs - sum(seats.values()))
            total_weight = sum(self.weight(t) for t in heavy)
            seats.update((t, max(1, int(capacity * self.weight(t) / total_weight))) for t in heavy)
        return seats

    def preempt_for_arrivals(self, out: SchedulerOutput) -> None:
        if len(self._live) < 2 or not self.waiting or not self.running:
            return
        head = self.order_waiting(self.waiting)[0]
        if head.request_id in self._preempted_now or not self.may_admit(head):
            return
        tenant = head.tenant
        seats = Counter(r.tenant for r in self.running)
        total_weight = sum(self.weight(t) for t in self._live)
        share = {t: self.max_num_seqs * self.weight(t) / total_weight for t in self._live}
        if seats[tenant] >= share.get(tenant, 0.0):
            return  # it holds its share: it waits like anyone else
        while not self._fits(head):
            over = [t for t in seats if t != tenant and seats[t] > share.get(t, 0.0)]
            if not over:
                return
            donor = max(over, key=lambda t: seats[t] - share[t])
            victim = self.choose_victim([r for r in self.running if r.tenant == donor])
            self.preempt(victim, out)
            seats[donor] -= 1

    def _fits(self, req: Sequence) -> bool:
        if len(self.running) >= self.max_num_seqs:
            return False
        computed_blocks, num_cached = self.kv.get_computed_blocks(req)
        num_new = self._num_new_tokens(req, self.max_num_batched_tokens, num_cached)
        return num_new > 0 and self.kv.num_blocks_to_take(req, num_new, computed_blocks) <= self.kv.num_free_blocks

    def tenant_counters(self) -> dict[Optional[str], float]:
        """Each tenant's service so far, in weighted token units (for metrics and tests)."""
        return dict(self.service)
