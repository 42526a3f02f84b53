"""Preemption by recompute and by swap, priority preemption, and random interleavings of add / step /
abort / preempt (hypothesis) checked against the simulated KV contents; then the real default model
under a tiny KV cache generates exactly what it generates with room to spare.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagoda import LLM, SamplingParams
from pagoda.modeling.default_model import ensure_default_model
from pagoda.sequence import SequenceStatus
from pagoda.step import SchedulerOutput
from scheduling_sim import (SimRunner, assert_kv_consistent, assert_prefix_cache_matches_contents, expected_output,
                            make_request, make_scheduler,
                            run_until_done, step)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 5000) for _ in range(n)]


def fill_until_preempted(policy: str, mode: str, num_swap_blocks: int = 32):
    """Three requests in a 10-block pool (4 tokens each) that cannot all grow to their 20 tokens."""
    s = make_scheduler(policy, num_blocks=10, block_size=4, budget=64, preemption_mode=mode,
                       num_swap_blocks=num_swap_blocks)
    runner = SimRunner(10, 4, num_swap_blocks)
    reqs = [make_request(f"r{i}", prompt(8, i), max_tokens=12, priority=p, arrival=float(i))
            for i, p in enumerate([1, 0, 2])]
    for r in reqs:
        s.add_request(r)
    while not s.num_preemptions:
        sched = step(s, runner)
    return s, runner, reqs, sched


def test_recompute_preemption_frees_the_newest_request_and_requeues_it_first():
    s, runner, reqs, sched = fill_until_preempted("fcfs", "recompute")
    assert sched.preempted == [reqs[2]]
    assert reqs[2].status == SequenceStatus.PREEMPTED and reqs[2].num_computed_tokens == 0
    assert s.kv.num_blocks_held("r2") == 0 and s.waiting[0] is reqs[2]
    run_until_done(s, runner)
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 12)
    assert s.kv.num_free_blocks == 10


def test_a_recomputed_request_reuses_its_blocks_from_the_prefix_cache():
    s = make_scheduler("fcfs", num_blocks=6, block_size=4, budget=64)
    runner = SimRunner(6, 4)
    first = make_request("first", prompt(10, 1), max_tokens=7)
    victim = make_request("victim", prompt(9, 2), max_tokens=4)
    s.add_request(first)
    s.add_request(victim)
    while not s.num_preemptions:
        step(s, runner)
    assert victim.status == SequenceStatus.PREEMPTED and s.kv.stats.hits == 0
    run_until_done(s, runner)
    assert s.kv.stats.hits >= 8  # its two full blocks were still cached when it came back
    assert victim.output_token_ids == expected_output(victim.prompt_token_ids, 4)


def test_swap_preemption_moves_blocks_out_and_brings_them_back():
    s, runner, reqs, sched = fill_until_preempted("fcfs", "swap")
    victim = reqs[2]
    assert victim.status == SequenceStatus.SWAPPED and s.swapped == [victim]
    assert len(sched.blocks_to_swap_out) == s.kv.num_swap_blocks - s.kv.num_free_swap_blocks
    computed = victim.num_computed_tokens
    while victim.status == SequenceStatus.SWAPPED:
        sched = step(s, runner)
    assert sched.blocks_to_swap_in and victim.num_computed_tokens > computed  # resumed, not recomputed
    run_until_done(s, runner)
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 12)
    assert s.kv.num_free_swap_blocks == 32


def test_swap_preemption_falls_back_to_recompute_when_the_swap_pool_is_full():
    s, runner, reqs, _ = fill_until_preempted("fcfs", "swap", num_swap_blocks=1)
    assert reqs[2].status == SequenceStatus.PREEMPTED and not s.swapped
    run_until_done(s, runner)
    assert all(r.output_token_ids == expected_output(r.prompt_token_ids, 12) for r in reqs)


def test_priority_preempts_the_lowest_priority_running_request():
    s, runner, reqs, sched = fill_until_preempted("priority", "recompute")
    assert sched.preempted == [reqs[2]]  # priority 2 is the lowest
    assert [r.request_id for r in s.running] == ["r1", "r0"]


def test_a_high_priority_arrival_preempts_lower_priority_running_work():
    s = make_scheduler("priority", num_blocks=8, block_size=4, budget=64)
    runner = SimRunner(8, 4)
    low = [make_request(f"low{i}", prompt(14, i), max_tokens=8, priority=5, arrival=float(i)) for i in range(2)]
    for r in low:
        s.add_request(r)
    step(s, runner)
    urgent = make_request("urgent", prompt(10, 9), max_tokens=4, priority=0, arrival=9.0)
    s.add_request(urgent)
    sched = step(s, runner)
    assert sched.preempted == [low[1]] and urgent in sched.requests
    finished = []
    while s.has_unfinished_requests():
        step(s, runner)
        finished += [r.request_id for r in s.drain_finished()]
    assert finished[0] == "urgent"
    for r in low + [urgent]:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling_params.max_tokens)


def test_an_arrival_does_not_preempt_work_of_the_same_priority():
    s = make_scheduler("priority", num_blocks=8, block_size=4, budget=64)
    runner = SimRunner(8, 4)
    for i in range(2):
        s.add_request(make_request(f"a{i}", prompt(14, i), max_tokens=8, priority=1, arrival=float(i)))
    step(s, runner)
    s.add_request(make_request("b", prompt(10, 9), max_tokens=4, priority=1, arrival=9.0))
    assert not step(s, runner).preempted


# ---- random interleavings ------------------------------------------------------------------------

PREFIXES = [prompt(24, 100), prompt(24, 101)]

add_op = st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 24), st.integers(0, 3), st.integers(1, 3),
                   st.integers(0, 2), st.integers(0, 24))
step_op = st.tuples(st.just("step"), st.integers(1, 4))
abort_op = st.tuples(st.just("abort"), st.integers(0, 50))
preempt_op = st.tuples(st.just("preempt"), st.integers(0, 50))
config = st.fixed_dictionaries({
    "policy": st.sampled_from(["fcfs", "priority"]),
    "preemption_mode": st.sampled_from(["recompute", "swap"]),
    "num_blocks": st.integers(4, 24),
    "block_size": st.sampled_from([2, 4, 8]),
    "budget": st.integers(8, 48),
    "chunked": st.booleans(),
    "long_prefill_token_threshold": st.sampled_from([0, 3, 8]),
    "prefix_caching": st.booleans(),
    "num_swap_blocks": st.integers(0, 24),
})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config, st.lists(st.one_of(add_op, step_op, add_op, step_op, abort_op, preempt_op), min_size=6, max_size=40))
def test_random_interleavings_keep_the_books_and_every_request_ends(cfg, ops):
    # without chunked prefill the engine insists every sequence fits one step's budget
    max_model_len = 200 if cfg["chunked"] else 80
    if not cfg["chunked"]:
        cfg["budget"] = max_model_len
    s = make_scheduler(max_num_seqs=8, max_model_len=max_model_len, **cfg)
    kv, bs = s.kv, cfg["block_size"]
    runner = SimRunner(cfg["num_blocks"], bs, cfg["num_swap_blocks"])
    added, aborted = [], set()
    rng = random.Random(0)
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, priority, n, prefix_choice, prefix_len = op
            base = PREFIXES[prefix_choice][:prefix_len] if prefix_choice < 2 else []
            ids = (base + [rng.randrange(100, 5000) for _ in range(length)])[:48]
            if kv.blocks_needed(len(ids) + 1) > cfg["num_blocks"]:
                continue  # the engine rejects such a prompt before it reaches the scheduler
            parent = f"p{len(added)}"
            for i in range(n):
                req = make_request(f"{parent}-{i}", ids, max_tokens, priority, float(len(added)), n, parent)
                s.add_request(req)
                added.append(req)
        elif op[0] == "step":
            for _ in range(op[1]):
                sched = step(s, runner)
                for kind in ("preempted", "blocks_to_swap_in", "blocks_to_copy"):
                    if getattr(sched, kind):
                        event(kind)  # shown by --hypothesis-show-statistics
        elif op[0] == "abort" and added:
            req = added[op[1] % len(added)]
            if not req.is_finished:
                s.abort_requests([req.request_id])
                aborted.add(req.request_id)
        elif op[0] == "preempt" and s.running:
            # what the scheduler does when the pool runs dry, forced at an arbitrary moment
            out = SchedulerOutput()
            s.preempt(s.running[op[1] % len(s.running)], out)
            s.update(out, runner.execute(out))  # preempt() decides; update() commits (the reset of progress)
        assert_kv_consistent(kv)
        assert_prefix_cache_matches_contents(runner, kv)
        for req in s.running:
            assert kv.num_blocks_held(req.request_id) == kv.blocks_needed(req.num_computed_tokens)
        for req in s.waiting:
            assert kv.num_blocks_held(req.request_id) == 0 and req.num_computed_tokens == 0
        for req in s.swapped:
            assert kv.is_swapped(req.request_id)
    run_until_done(s, runner, max_steps=5000)
    for req in added:
        capacity_needed = kv.blocks_needed(req.num_prompt_tokens + req.sampling_params.max_tokens - 1)
        if req.request_id in aborted:
            assert req.status == SequenceStatus.FINISHED_ABORTED
        elif req.status == SequenceStatus.FINISHED_ERROR:
            assert capacity_needed > cfg["num_blocks"] and req.error
        else:
            assert req.status == SequenceStatus.FINISHED_LENGTH
            assert req.output_token_ids == expected_output(req.prompt_token_ids, req.sampling_params.max_tokens)
    assert kv.num_free_blocks == cfg["num_blocks"] and kv.num_free_swap_blocks == cfg["num_swap_blocks"]
    assert not kv._tables and not kv._swapped and not kv._hashes and not kv._num_slots


# ---- the real default model under a tiny KV cache ------------------------------------------------

MODEL_PROMPTS = [[random.Random(i).randrange(1000, 30000) for _ in range(n)]
                 for i, n in enumerate((30, 45, 21, 38, 50))]
MODEL_PARAMS = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True) if i % 2 == 0 else
                SamplingParams(temperature=0.9, top_p=0.9, seed=30 + i, max_tokens=14, ignore_eos=True)
                for i in range(len(MODEL_PROMPTS))]


def make_llm(**kwargs) -> LLM:
    """The default model in bf16, the batch-invariant mode making a resumed request's tokens the bits of an
    uninterrupted run (docs/batch_invariance.md)."""
    ensure_default_model()
    return LLM(dtype="bfloat16", batch_invariant=True, max_model_len=256, cpu_threads=1, **kwargs)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def roomy_reference():
    """Every request generated with a cache large enough that nothing is ever preempted."""
    llm = make_llm(kv_cache_memory_bytes=24 << 20)
    outs = llm.generate([{"prompt_token_ids": p} for p in MODEL_PROMPTS], MODEL_PARAMS, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions == 0
    return token_ids(outs)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_resume_with_identical_tokens(roomy_reference, mode):
    # 10 blocks of 16 tokens for 5 requests that grow to 35-64 tokens each
    llm = make_llm(num_gpu_blocks_override=10, preemption_mode=mode, swap_space=0.05)
    engine = llm.engine
    swapped_out = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        sched = schedule()
        swapped_out.extend(sched.blocks_to_swap_out)
        return sched

    engine.scheduler.schedule = recording_schedule
    outs = llm.generate([{"prompt_token_ids": p} for p in MODEL_PROMPTS], MODEL_PARAMS, use_tqdm=False)
    assert token_ids(outs) == roomy_reference
    assert engine.scheduler.num_preemptions > 0
    assert bool(swapped_out) == (mode == "swap")
    assert engine.kv_manager.num_free_blocks == 10 and engine.kv_manager.num_free_swap_blocks == \
        engine.kv_manager.num_swap_blocks


@pytest.mark.slow
def test_under_a_saturated_cache_high_priority_requests_finish_first(roomy_reference):
    # 8 blocks: exactly what the two high-priority requests grow to, so every low one must yield
    llm = make_llm(num_gpu_blocks_override=8, scheduling_policy="priority")
    engine = llm.engine
    low = [0, 2, 4]
    for i in low:
        engine.add_request(f"low{i}", {"prompt_token_ids": MODEL_PROMPTS[i]}, MODEL_PARAMS[i], priority=5)
    for _ in range(3):
        engine.step()  # the low-priority requests hold the cache
    for i in (1, 3):
        engine.add_request(f"high{i}", {"prompt_token_ids": MODEL_PROMPTS[i]}, MODEL_PARAMS[i], priority=0)
    order, results = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                results[out.request_id] = out.outputs[0].token_ids
    assert set(order[:2]) == {"high1", "high3"}
    assert engine.scheduler.num_preemptions >= 3
    for rid, tokens in results.items():
        assert tokens == roomy_reference[int(rid[-1])]
