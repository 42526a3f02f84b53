"""Lanes: which running sequences each step in flight may hold, when pipeline stages overlap steps.

With one step at a time, the first pipeline stage idles while the later ones run the step, and they idle while
it runs the next. With ``pipeline_batches_in_flight = n`` > 1 the engine (:meth:`LLMEngine.step`) keeps up to
``n`` steps in the stages at once, as vLLM's virtual engines do: the sequences are split into ``n`` lanes, and
each step is scheduled from one lane's sequences (:meth:`Scheduler.schedule_excluding`, every other sequence
busy) while the steps of the other lanes are still in the later stages. This module keeps the lanes' books:

- A lane has at most one step in flight, so no sequence is in two steps at once, and one that is in flight is
  invisible to the next schedule: it is neither scheduled, preempted nor admitted there.
- New requests join the lane with the fewest sequences; before a lane is scheduled, the running sequences it
  holds beyond its share (the running ones over ``n``) move to the lanes with the fewest, and so do its others
  beyond their share (waiting, swapped out): the lanes stay even as requests finish and as seats
  (``max_num_seqs``) free up. A sequence moves only while it is in no step in flight.

One lane per step means one lane's sequences per step: with ``n`` lanes a step holds about ``1/n`` of the
running sequences, and the stages each run ``n`` steps in the time the one-step loop ran one.
"""

from __future__ import annotations

from typing import Container

from pagoda.sequence import Sequence, SequenceStatus


class _OtherLanes:
    """The busy set of a lane's schedule: every sequence of another lane, and any sequence in flight."""

    def __init__(self, lane_of: dict[str, int], in_flight: Container[str], lane: int) -> None:
        self.lane_of = lane_of
        self.in_flight = in_flight
        self.lane = lane

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.in_flight or self.lane_of.get(request_id, self.lane) != self.lane


class Lanes:
    """``num_lanes`` lanes of sequences taking turns, one step in flight each (see the module docstring)."""

    def __init__(self, num_lanes: int) -> None:
        self.num_lanes = num_lanes
        # each lane's live sequences by request id (insertion order: the newest move first)
        self.lanes: list[dict[str, Sequence]] = [{} for _ in range(num_lanes)]
        self.lane_of: dict[str, int] = {}
        self.next_lane = 0

    def add(self, sequences: list[Sequence]) -> None:
        """New sequences (one request's) join the lane with the fewest."""
        lane = min(range(self.num_lanes), key=lambda i: len(self.lanes[i]))
        for seq in sequences:
            self.lanes[lane][seq.request_id] = seq
            self.lane_of[seq.request_id] = lane

    def take_turn(self, busy_lanes: Container[int]) -> int | None:
        """The lane whose turn it is to be scheduled, or None while that lane still has a step in flight
        (``busy_lanes``); the turn then passes to the next lane."""
        lane = self.next_lane
        if lane in busy_lanes:
            return None
        self.next_lane = (lane + 1) % self.num_lanes
        self._even_out(lane)
        return lane

    def busy(self, lane: int, in_flight: Container[str]) -> Container[str]:
        """The request ids a schedule of lane ``lane`` must leave alone: the other lanes' and those in a step
        in flight (``in_flight``)."""
        return _OtherLanes(self.lane_of, in_flight, lane)

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
