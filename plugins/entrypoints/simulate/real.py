"""Replay a trace through the real engine, in process and on the wall clock, measuring what the
simulator reports for the same trace (``pagoda simulate --compare-real``).

Requests join between steps once their arrival time has passed, as they do in ``pagoda serve``'s
engine loop; times are from the trace's start, without HTTP. The engine is warmed up first (one
request), so kernel builds and first-touch allocation stay out of the measurement.
"""

from __future__ import annotations

import time
from typing import Sequence as Seq

from pagoda.errors import InvalidRequestError
from pagoda.plugins.entrypoints.simulate.cost_model import step_features
from pagoda.plugins.entrypoints.simulate.simulator import RunRecord
from pagoda.plugins.entrypoints.simulate.trace import PromptMaker, TraceRequest
from pagoda.sampling_params import SamplingParams


class _StepObserver:
    """Per step: its end time, seconds, KV usage, preemptions, swaps, first scheduling of each request."""

    def __init__(self, record: RunRecord, start: float) -> None:
        self.record = record
        self.start = start
        # (cost-model features, seconds) of every step that ran requests: how the machine really performed
        self.samples: list[tuple[tuple[float, ...], float]] = []

    def before_step(self, engine, sched) -> None:
        now = time.perf_counter() - self.start
        first = self.record.first_scheduled
        for req in sched.requests:
            i = int(req.parent_id or req.request_id)
            if first[i] != first[i]:
                first[i] = now

    def after_step(self, engine, sched, result, seconds: float) -> None:
        rec = self.record
        if sched.preempted:
            rec.num_preemptions += len(sched.preempted)
            rec.num_swapped_out += sum(1 for r in sched.preempted if engine.kv_manager.is_swapped(r.request_id))
        rec.num_blocks_swapped += len(sched.blocks_to_swap_out) + len(sched.blocks_to_swap_in)
        if result is None:
            return
        rec.step_end.append(time.perf_counter() - self.start)
        rec.step_seconds.append(seconds)
        rec.kv_usage.append(engine.kv_manager.usage)
        if sched.requests:
            self.samples.append((step_features(sched.num_new_tokens, sched.num_computed_before), seconds))


def warm_up(engine, prompts: PromptMaker) -> None:
    """One request through the engine; its prompt shares no block with any trace request."""
    req = TraceRequest(0.0, 8, min(256, engine.config.model.max_model_len // 2))
    engine.add_request("pagoda-warm-up", {"prompt_token_ids": prompts.tokens(2 * 10 ** 9 + 7, req)},
                       SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()


def replay_real(engine, trace: Seq[TraceRequest], prompts: PromptMaker
                ) -> tuple[RunRecord, list[tuple[tuple[float, ...], float]]]:
    """Run ``trace`` (sorted by arrival) through ``engine`` (an idle LLMEngine) on the wall clock; returns what
    it measured and the (cost-model features, seconds) of each step."""
    record = RunRecord(trace)
    stats = engine.kv_manager.stats
    queries0, hits0 = stats.queries, stats.hits
    start = time.perf_counter()
    mono_start = time.monotonic()
    observer = _StepObserver(record, start)
    engine.observers.append(observer)
    params: dict[int, SamplingParams] = {}
    n, i = len(trace), 0
    first, last, itl = record.first_token, record.last_token, record.itl
    try:
        while i < n or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while i < n and trace[i].arrival <= now:
                req = trace[i]
                p = params.get(req.output_len)
                if p is None:
                    p = params[req.output_len] = SamplingParams(max_tokens=req.output_len, ignore_eos=True,
                                                                temperature=0.0)
                try:
                    engine.add_request(str(i), {"prompt_token_ids": prompts.tokens(i, req)}, p,
                                       arrival_time=mono_start + req.arrival, priority=req.priority)
                except InvalidRequestError as exc:
                    record.errors[i] = str(exc)
                i += 1
            if not engine.has_unfinished_requests():
                if i < n:
                    time.sleep(max(0.0, trace[i].arrival - (time.perf_counter() - start)))
                continue
            outputs = engine.step()
            t = time.perf_counter() - start
            for out in outputs:
                k = int(out.request_id)
                num_tokens = len(out.outputs[0].token_ids)
                if num_tokens > record.num_output[k]:
                    if first[k] != first[k]:
                        first[k] = t
                    else:
                        itl.append(t - last[k])
                    last[k] = t
                    record.num_output[k] = num_tokens
                if out.finished:
                    record.finish[k] = t
                    if out.error:
                        record.errors[k] = out.error
    finally:
        engine.observers.remove(observer)
    record.prefix_queries, record.prefix_hits = stats.queries - queries0, stats.hits - hits0
    return record, observer.samples
