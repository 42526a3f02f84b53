"""Steps in flight, without a model: a scheduling policy under ``Scheduler.schedule_excluding`` (pipeline stages).

The engine over pipeline stages (``LLMEngine.step`` with lanes) schedules a step while the step ahead of it is
still in the later stages, from one lane of sequences, every other lane's and every sequence in flight busy;
it commits each step with ``update`` one step later, in order. This drives a scheduler the same way: two lanes
(by request), each step run on :class:`SimRunner` as soon as it is scheduled (the stages run steps in the order
submitted) and committed after the next one is scheduled, with aborts of requests in flight held back until
their step is committed. It raises :class:`ContractError` when a step touches a busy sequence (schedules,
admits, swaps, preempts or fails it; a policy preempting one is refused by the scheduler and reported so), when a sequence attends to K/V not its own, when an abort in flight
finds its blocks already freed, when a sequence ends with the wrong tokens, when blocks are not given back, or when a
hook raises (named with its method: a policy keeping per-step state in one field that ``on_step_start`` resets
finds it reset by the next step before ``on_step_executed`` of the step ahead runs).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Optional

from pagoda.errors import SchedulingPolicyError
from pagoda.interfaces import SchedulerFactory
from pagoda.sequence import Sequence, SequenceStatus
from pagoda.step import RunnerOutput, SchedulerOutput
from pagoda.testing.contract import ContractError, Where
from pagoda.testing.scheduling import (SETTINGS, STREAM_BUDGET, STREAM_NUM_BLOCKS, AllocatorFactory, SimRunner,
                                       _add_request, _stream_setup, check_liveness, expected_output, policy_error,
                                       raised)


def check_steps_in_flight(factory: SchedulerFactory, allocator: Optional[AllocatorFactory] = None, seeds: int = 3,
                          num_requests: int = 24, options: Optional[dict] = None) -> None:
    """Drive the scheduler with the policy ``factory(scheduler, **options)`` through randomised request streams
    with two steps in flight (see the module docstring). Raises ContractError."""
    for settings in SETTINGS:
        for seed in range(seeds):
            _run_stream(factory, allocator, settings, seed, num_requests, options)


def _touched(sched: SchedulerOutput) -> set[str]:
    return {r.request_id for r in (*sched.requests, *sched.preempted, *(req for req, _ in sched.failed))}


def _run_stream(factory: SchedulerFactory, allocator: Optional[AllocatorFactory], settings: dict, seed: int,
                num_requests: int, options: Optional[dict] = None) -> None:
    rng = random.Random(seed)
    num_blocks, budget = STREAM_NUM_BLOCKS, STREAM_BUDGET
    scheduler, kv, sched_cfg, runner = _stream_setup(factory, allocator, settings, options)
    where = Where(str(getattr(factory, "__name__", factory)), seed,
                  ", ".join(f"{k}={v}" for k, v in settings.items()) + ", two steps in flight")
    prefixes = [[rng.randrange(100, 5000) for _ in range(12)] for _ in range(2)]
    added: list[Sequence] = []
    lane_of: dict[str, int] = {}
    aborted: dict[str, int] = {}  # request id -> blocks it held when its abort was held back
    arrived: dict[str, int] = {}  # request id -> the step it was added at
    in_flight: deque = deque()  # (step, its result, request ids whose abort waits for it)
    longest = sched_cfg.max_model_len if settings["chunked"] else budget
    for step in range(5000):
        at = where.at(step)
        if len({r.parent_id for r in added}) < num_requests and rng.random() < 0.5:
            new = _add_request(scheduler, rng, prefixes, len(added), longest, kv, num_blocks)
            for seq in new:
                lane_of[seq.request_id] = len({r.parent_id for r in added}) % 2
                arrived[seq.request_id] = step
            added += new
        check_liveness(added, arrived, step, at)
        flying = set().union(*(_touched(s) for s, _, _ in in_flight))
        if added and rng.random() < 0.03:
            victim = rng.choice(added)
            if not victim.is_finished and victim.request_id not in aborted:
                waits = next((w for s, _, w in in_flight if victim.request_id in _touched(s)), None)
                if waits is None:
                    scheduler.abort_requests([victim.request_id])
                else:  # its step may still write its blocks: the engine aborts it when the step is committed
                    waits.append(victim.request_id)
                aborted[victim.request_id] = kv.num_blocks_held(victim.request_id)
        if not scheduler.has_unfinished_requests() and not in_flight:
            if len({r.parent_id for r in added}) >= num_requests:
                break
            continue
        lane = step % 2
        busy = {rid for rid, other in lane_of.items() if other != lane} | flying
        try:
            sched = scheduler.schedule_excluding(busy)
        except SchedulingPolicyError as exc:
            raise policy_error(at, "schedule_excluding()", exc) from None
        except ContractError:
            raise
        except Exception as exc:  # a hook (or the allocator) raised: named with its method, the seed and the step
            raise raised(at, "schedule_excluding(), with the step ahead still in flight", exc, scheduler) from exc
        if _touched(sched) & busy:
            raise at.fail("schedule_excluding()", f"the step touched busy requests {sorted(_touched(sched) & busy)}",
                          "a busy sequence (in a step in flight, or another lane's) is neither scheduled, admitted, "
                          "swapped, preempted nor failed", "the scheduler's schedule_excluding() (or a policy "
                          "hook that picks requests without self.scheduler.is_busy())")
        if sched.requests:
            in_flight.append((sched, _execute(runner, sched, at), []))
        else:  # no step to keep in flight: its block moves (a swap-out) run now, its decisions commit now
            scheduler.update(sched, _execute(runner, sched, at))
        if len(in_flight) == 2 or (in_flight and not sched.requests):
            _commit(scheduler, kv, *in_flight.popleft(), aborted, at)
    else:
        raise where.fail("the whole stream", "requests still unfinished after 5000 steps", "every request finishes",
                         "the scheduler's schedule_excluding() (a request never scheduled)")
    end = where.at("end", "at the")
    for req in added:
        if req.request_id in aborted or req.status == SequenceStatus.FINISHED_ERROR:
            continue
        want = expected_output(req.prompt_token_ids, req.sampling_params.max_tokens)
        if req.status != SequenceStatus.FINISHED_LENGTH or req.output_token_ids != want:
            raise end.fail("the finished requests", f"{req.request_id} ended {req.status.value} with "
                           f"{req.output_token_ids[:6]}..., not {want[:6]}...", "a sequence ends with exactly the "
                           "tokens of its prompt's continuation, with steps in flight as with one",
                           "the scheduler's update() or schedule_excluding()")
    if kv.num_free_blocks != num_blocks:
        raise end.fail("the KV allocator's books", f"{num_blocks - kv.num_free_blocks} of {num_blocks} KV blocks "
                       "were not given back", "every ended sequence gives back its blocks",
                       "the scheduler's finish()/preempt()")


def _execute(runner: SimRunner, sched: SchedulerOutput, at: Where) -> RunnerOutput:
    try:
        return runner.execute(sched)
    except ContractError as exc:
        raise at.fail("the model runner's execute() of the step", str(exc), "a sequence attends only to K/V its "
                      "own tokens wrote, with another step's sequences in flight", "the scheduler's "
                      "schedule_excluding() (a busy sequence's blocks given to this step)") from None


def _commit(scheduler, kv, sched: SchedulerOutput, result: RunnerOutput, waits: list[str], aborted: dict[str, int],
            at: Where) -> None:
    """Commit a step in flight: the aborts that waited for it first, then ``update``."""
    for rid in waits:
        if kv.num_blocks_held(rid) != aborted[rid]:
            raise at.fail("an abort held back for a step in flight", f"{rid} held {aborted[rid]} blocks at its "
                          f"abort and {kv.num_blocks_held(rid)} before its step was committed", "the blocks of a "
                          "sequence in flight stay its own until its step is committed",
                          "the scheduler's schedule_excluding() (a busy sequence's blocks freed)")
    scheduler.abort_requests(waits)
    try:
        scheduler.update(sched, result)
    except ContractError:
        raise
    except Exception as exc:  # e.g. on_step_executed() reading per-step state the next step's hooks already reset
        raise raised(at, "update() of the step ahead, committed after this step was scheduled", exc, scheduler,
                     "a hook answers without raising with steps in flight, where the next step's on_step_start() and "
                     "on_request_scheduled() run before on_step_executed() of the step ahead (keep per-step state by "
                     "step, e.g. keyed by request id, not in one field on_step_start() resets)") from exc
