"""Steps in flight: the engine loop when pipeline stages overlap (``pipeline_batches_in_flight`` > 1).

With one step at a time, the first pipeline stage idles while the later ones run the step, and they idle while
it runs the next. Here the engine keeps up to ``n`` steps in the stages at once, as vLLM's virtual engines do:
the running sequences are split into ``n`` lanes, each step is scheduled from one lane's sequences
(:meth:`Scheduler.schedule_excluding`, every other sequence busy) and submitted to the executor
(``Executor.submit``) while the steps of the other lanes are still in the later stages; steps are collected
and committed (``Scheduler.update``) in the order submitted, so the scheduler's contract (schedule, execute,
update) holds per step.

- A lane has at most one step in flight, so no sequence is in two steps at once, and one that is in flight is
  invisible to the next schedule: it is neither scheduled, preempted nor admitted there.
- New requests join the lane with the fewest sequences; before a lane is scheduled, the running sequences it
  holds beyond its share (the running ones over ``n``) move to the lanes with the fewest, and so do its others
  beyond their share (waiting, swapped out): the lanes stay even as requests finish and as seats
  (``max_num_seqs``) free up. A sequence moves only while it is in no step in flight.
- An abort of a request whose sequence is in a step in flight takes effect when that step is collected: its
  blocks are freed then, not while the later stages may still write them.
- A fault in a step's execution is isolated as in the one-step loop (:meth:`LLMEngine._isolate_fault`), once
  the steps submitted before it are collected; a request that fails alone ends alone.

One lane per step means one lane's sequences per step: with ``n`` lanes a step holds about ``1/n`` of the
running sequences, and the stages each run ``n`` steps in the time the one-step loop ran one.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Optional

from pagoda.outputs import EngineOutput
from pagoda.sequence import Sequence, SequenceStatus
from pagoda.step import RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagoda.engine.llm_engine import LLMEngine

logger = logging.getLogger("pagoda")


class _InFlight:
    """A step submitted and not yet collected: its lane, schedule, the executor's handle, when it was
    submitted, and the sequences whose aborts wait for it."""

    def __init__(self, lane: int, sched: SchedulerOutput, handle: object, submitted: float) -> None:
        self.lane = lane
        self.sched = sched
        self.handle = handle
        self.submitted = submitted
        self.aborts: list[str] = []


class _OtherLanes:
    """The busy set of a lane's schedule: every sequence of another lane, and any sequence in flight."""

    def __init__(self, lane_of: dict[str, int], in_flight: dict[str, _InFlight], lane: int) -> None:
        self.lane_of = lane_of
        self.in_flight = in_flight
        self.lane = lane

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.in_flight or self.lane_of.get(request_id, self.lane) != self.lane


class BatchesInFlight:
    """Up to ``num_lanes`` steps in the pipeline stages at once (see the module docstring)."""

    def __init__(self, engine: "LLMEngine", num_lanes: int) -> None:
        self.engine = engine
        self.num_lanes = num_lanes
        # each lane's live sequences by request id (insertion order: the newest move first)
        self.lanes: list[dict[str, Sequence]] = [{} for _ in range(num_lanes)]
        self.lane_of: dict[str, int] = {}
        self.queue: deque[_InFlight] = deque()  # oldest first
        # request id -> the step in flight it is in (scheduled, preempted or failed there)
        self.step_of: dict[str, _InFlight] = {}
        self.next_lane = 0
        # the most steps in flight at once so far, and the steps submitted while another was in flight
        self.max_in_flight = 0
        self.num_overlapped = 0

    @classmethod
    def for_engine(cls, engine: "LLMEngine") -> Optional["BatchesInFlight"]:
        """The engine's steps in flight, or None (one step at a time, with a warning) when its scheduler or
        executor cannot keep more than one."""
        n = engine.config.parallel.pipeline_batches_in_flight
        if engine.scheduler.schedule_excluding is None:
            logger.warning("pipeline_batches_in_flight=%d: the %r scheduler has no schedule_excluding(), so steps "
                           "run one at a time", n, engine.config.scheduler.policy)
            return None
        executor = engine.executor
        if getattr(executor, "submit", None) is None or getattr(executor, "collect", None) is None:
            logger.warning("pipeline_batches_in_flight=%d: the %r executor has no submit()/collect(), so steps run "
                           "one at a time", n, engine.config.parallel.distributed_executor_backend)
            return None
        return cls(engine, n)

    # ---- sequences and lanes -----------------------------------------------------------------

    def add(self, sequences: list[Sequence]) -> None:
        """New sequences (one request's) join the lane with the fewest."""
        lane = min(range(self.num_lanes), key=lambda i: len(self.lanes[i]))
        for seq in sequences:
            self.lanes[lane][seq.request_id] = seq
            self.lane_of[seq.request_id] = lane

    def defer_aborts(self, request_ids: list[str]) -> list[str]:
        """Of ``request_ids`` (sequences to abort), those to abort now; the others are in a step in flight and
        are aborted when it is collected."""
        now = []
        for rid in request_ids:
            step = self.step_of.get(rid)
            if step is None:
                now.append(rid)
            else:
                step.aborts.append(rid)
        return now

    def _even_out(self, lane: int) -> None:
        """Forget finished sequences; then lane ``lane`` (no step of it in flight) gives the running sequences it
        holds beyond its share of the running ones to the lanes with the fewest, and likewise the others
        (waiting, swapped out): each step holds about ``1/num_lanes`` of the running sequences, and each lane
        has as many to start as the others."""
        for members in self.lanes:
            for rid in [rid for rid, seq in members.items() if seq.is_finished]:
                del members[rid]
                self.lane_of.pop(rid, None)
        self._give_away(lane, True)
        self._give_away(lane, False)

    def _give_away(self, lane: int, running: bool) -> None:
        """Move lane ``lane``'s running (or not running) sequences beyond its share of them, newest first, to the
        lanes holding the fewest."""
        def counts(members: dict[str, Sequence]) -> int:
            return sum(1 for seq in members.values() if (seq.status is SequenceStatus.RUNNING) is running)

        sizes = [counts(members) for members in self.lanes]
        share = -(-sum(sizes) // self.num_lanes)  # ceil
        if sizes[lane] <= share:
            return
        members = self.lanes[lane]
        movable = [rid for rid in reversed(members) if (members[rid].status is SequenceStatus.RUNNING) is running]
        for rid in movable:
            target = min(range(self.num_lanes), key=sizes.__getitem__)
            if sizes[lane] <= share or sizes[target] + 1 >= sizes[lane]:
                return
            self.lanes[target][rid] = members.pop(rid)
            self.lane_of[rid] = target
            sizes[target] += 1
            sizes[lane] -= 1

    # ---- the loop ----------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Fill the free lanes with steps (schedule, submit), then collect the oldest step in flight, commit
        it and emit its outputs. Raises :class:`StepFailedError` as the one-step loop does (the other steps
        stay in flight, collected by the next calls)."""
        engine = self.engine
        t0 = time.perf_counter()
        timings = {"schedule": 0.0, "execute": 0.0}
        self._fill(timings)
        if not self.queue:  # nothing runs: commit what the schedules decided (failures), emit what ended
            t1 = time.perf_counter()
            outputs = engine._emit([])
            engine.last_step_timings = {**timings, "update": 0.0, "emit": time.perf_counter() - t1}
            return outputs
        step = self.queue.popleft()
        t1 = time.perf_counter()
        result = self._collect(step)
        t2 = time.perf_counter()
        timings["execute"] += t2 - t1
        result.execute_seconds = t2 - step.submitted
        progressed = engine._update(step.sched, result)
        t3 = time.perf_counter()
        outputs = engine._emit(progressed)
        t4 = time.perf_counter()
        engine.last_step_timings = {**timings, "update": t3 - t2, "emit": t4 - t3}
        if engine.stats is not None:
            engine.stats.on_step_time(t4 - t0)
        for observer in engine.observers:
            observer.after_step(engine, step.sched, result, t4 - t0)
        return outputs

    def _fill(self, timings: dict[str, float]) -> None:
        """Schedule and submit a step for each free lane, in turn, until ``num_lanes`` are in flight."""
        engine = self.engine
        busy_lanes = {step.lane for step in self.queue}
        for _ in range(self.num_lanes):
            lane = self.next_lane
            if len(self.queue) >= self.num_lanes or lane in busy_lanes:
                return
            self.next_lane = (lane + 1) % self.num_lanes
            t0 = time.perf_counter()
            self._even_out(lane)
            sched = engine.scheduler.schedule_excluding(_OtherLanes(self.lane_of, self.step_of, lane))
            self._check(sched)
            t1 = time.perf_counter()
            timings["schedule"] += t1 - t0
            for observer in engine.observers:
                observer.before_step(engine, sched)
            if not sched.requests:
                if sched.has_block_moves:  # its swaps and copies run on every rank after the steps in flight
                    engine._prepare(sched)
                engine._update(sched, None)  # commits its failures and preemptions: nothing of this lane is in flight
                for observer in engine.observers:
                    observer.after_step(engine, sched, None, time.perf_counter() - t0)
                continue
            engine._prepare(sched)  # block moves, grammar rows; raises StepFailedError (rolled back)
            step = _InFlight(lane, sched, engine.executor.submit(sched), t1)
            timings["execute"] += time.perf_counter() - t1
            if self.queue:
                self.num_overlapped += 1
            self.queue.append(step)
            busy_lanes.add(lane)
            self.max_in_flight = max(self.max_in_flight, len(self.queue))
            for seq in (*sched.requests, *sched.preempted, *(req for req, _ in sched.failed)):
                self.step_of[seq.request_id] = step

    def _check(self, sched: SchedulerOutput) -> None:
        """A scheduler that touched a sequence in flight broke :meth:`Scheduler.schedule_excluding`."""
        for seq in (*sched.requests, *sched.preempted, *(req for req, _ in sched.failed)):
            if seq.request_id in self.step_of:
                raise RuntimeError(f"the {self.engine.config.scheduler.policy!r} scheduler's schedule_excluding() "
                                   f"touched {seq.request_id}, which is in a step still in flight; it must leave "
                                   "the busy request ids alone")

    def _collect(self, step: _InFlight) -> RunnerOutput:
        """The step's result, its fault isolated if its execution raised; then its sequences are no longer in
        flight and the aborts that waited for it take effect."""
        engine = self.engine
        try:
            try:
                return engine.executor.collect(step.handle)
            except Exception as exc:  # noqa: BLE001 - isolated: one request's fault must not fail the others
                return engine._isolate_fault(step.sched, exc)
        finally:
            for seq in (*step.sched.requests, *step.sched.preempted, *(req for req, _ in step.sched.failed)):
                self.step_of.pop(seq.request_id, None)
            if step.aborts:
                engine.scheduler.abort_requests(step.aborts)
