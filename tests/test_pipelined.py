"""Steps in flight (LLMEngine over pipeline stages, pagoda.engine.lanes), at the scheduler's level and without a
model: each step is scheduled with ``schedule_excluding`` and run on the SimRunner before the step ahead of it is
committed, in the engine's order, two lanes of sequences taking turns. The SimRunner checks every sequence attends
to its own tokens; the outputs must be a one-step-at-a-time run's. The engine over real pipeline stages is in
test_pipeline_parallel.py.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from pagoda.errors import SchedulingPolicyError
from pagoda.plugins.schedulers.fcfs import FCFSPolicy
from pagoda.sequence import SequenceStatus
from scheduling_sim import SimRunner, assert_kv_consistent, expected_output, make_request, make_scheduler

NUM_BLOCKS, BLOCK_SIZE = 14, 4


def touched(sched) -> set[str]:
    return {r.request_id for r in (*sched.requests, *sched.preempted, *(req for req, _ in sched.failed))}


def run_two_in_flight(scheduler, runner: SimRunner, requests: list, abort_in_flight: int = -1) -> dict:
    """Two lanes (even and odd requests), each step scheduled from one lane with the other lane and every step in
    flight busy, run at once (the stages run steps in the order submitted) and committed one step later. The
    ``abort_in_flight``-th request is aborted while a step of it is in flight, taking effect when that step is
    committed. Returns request id -> the held blocks seen at its abort (checked freed at the commit)."""
    lane_of = {r.request_id: i % 2 for i, r in enumerate(requests)}
    in_flight: deque = deque()  # (sched, result, request ids whose abort waits for it)
    aborted: dict[str, int] = {}
    lane, num_steps = 0, 0
    while scheduler.has_unfinished_requests() or in_flight:
        in_flight_ids = set().union(*(touched(s) for s, _, _ in in_flight))
        busy = {rid for rid, other in lane_of.items() if other != lane} | in_flight_ids
        sched = scheduler.schedule_excluding(busy)
        assert not touched(sched) & busy, f"the step touched busy requests {touched(sched) & busy}"
        if sched.requests:
            in_flight.append((sched, runner.execute(sched), []))
        else:  # nothing to keep in flight: its block moves (a swap-out) run now, its decisions commit now
            scheduler.update(sched, runner.execute(sched))
        victim = requests[abort_in_flight] if abort_in_flight >= 0 else None
        if victim is not None and victim.request_id not in aborted and victim.request_id in in_flight_ids \
                and not victim.is_finished:
            held = scheduler.kv.num_blocks_held(victim.request_id)
            aborted[victim.request_id] = held
            next(waits for s, _, waits in in_flight if victim.request_id in touched(s)).append(victim.request_id)
        if len(in_flight) == 2 or (in_flight and not sched.requests):
            done, result, waits = in_flight.popleft()
            for rid in waits:
                assert scheduler.kv.num_blocks_held(rid) == aborted[rid], "an abort in flight freed blocks early"
            scheduler.abort_requests(waits)
            scheduler.update(done, result)
            for rid in waits:
                assert scheduler.kv.num_blocks_held(rid) == 0
        lane = 1 - lane
        num_steps += 1
        assert num_steps < 5_000, "requests never finish"
    return aborted


def requests_for(seed: int, n: int = 10) -> list:
    rng = random.Random(seed)
    shared = [rng.randrange(100, 5000) for _ in range(5)]  # a prefix some share (prefix cache, copy-on-write)
    out = []
    for i in range(n):
        own = [rng.randrange(100, 5000) for _ in range(rng.randrange(2, 9))]
        out.append(make_request(f"r{i}", (shared if i % 3 == 0 else []) + own, max_tokens=rng.randrange(3, 10),
                                priority=rng.randrange(3), arrival=float(i)))
    return out


def fair_scheduler(preemption_mode: str = "recompute", num_swap_blocks: int = 0):
    return make_scheduler("fair", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, preemption_mode=preemption_mode,
                          num_swap_blocks=num_swap_blocks, step_seqs=2, step_ms=0)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_steps_in_flight_give_each_request_its_tokens_through_preemption(policy, preemption_mode, seed):
    swap = 16 if preemption_mode == "swap" else 0
    if policy == "fair":
        scheduler = fair_scheduler(preemption_mode, swap)
    else:
        scheduler = make_scheduler(policy, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                   preemption_mode=preemption_mode, num_swap_blocks=swap)
    runner = SimRunner(NUM_BLOCKS, BLOCK_SIZE, swap)
    requests = requests_for(seed)
    for i, req in enumerate(requests):
        if policy == "fair":
            req.tenant = f"t{i % 3}"
        scheduler.add_request(req)
    run_two_in_flight(scheduler, runner, requests)
    assert scheduler.num_preemptions > 0  # the pool is too small for them all
    for req in requests:
        assert req.status is SequenceStatus.FINISHED_LENGTH
        assert req.output_token_ids == expected_output(req.prompt_token_ids, req.sampling_params.max_tokens)
    assert_kv_consistent(scheduler.kv)
    assert scheduler.kv.num_free_blocks == NUM_BLOCKS


def test_an_abort_in_flight_frees_the_blocks_when_its_step_is_committed_and_the_others_finish():
    scheduler = make_scheduler("fcfs", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    requests = requests_for(3, n=6)
    for req in requests:
        scheduler.add_request(req)
    aborted = run_two_in_flight(scheduler, SimRunner(NUM_BLOCKS, BLOCK_SIZE), requests, abort_in_flight=1)
    assert aborted.get("r1", 0) > 0
    assert requests[1].status is SequenceStatus.FINISHED_ABORTED
    for req in requests[:1] + requests[2:]:
        assert req.output_token_ids == expected_output(req.prompt_token_ids, req.sampling_params.max_tokens)
    assert scheduler.kv.num_free_blocks == NUM_BLOCKS


class PreemptsAnyone(FCFSPolicy):
    """A policy that preempts the newest running request for arrivals, busy or not."""

    def preempt_for_arrivals(self, out):
        s = self.scheduler
        if s.waiting and s.running:
            s.preempt(s.running[-1], out)


def test_a_policy_preempting_a_request_in_flight_is_refused_naming_the_rule():
    scheduler = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, policy_cls=PreemptsAnyone)
    scheduler.add_request(make_request("a", [5, 6, 7]))
    first = scheduler.schedule()
    scheduler.add_request(make_request("b", [8, 9]))
    with pytest.raises(SchedulingPolicyError, match="PreemptsAnyone policy preempted a, which is in a step still "
                                                    "in flight"):
        scheduler.schedule_excluding({"a"})
    assert first.requests[0].request_id == "a"
