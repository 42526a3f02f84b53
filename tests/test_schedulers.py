"""The built-in scheduling policies: order, token budget, chunked prefill, fairness, limits, abort.

Most tests drive the scheduler and the KV manager with the model-free SimRunner;
the last one checks chunked prefill against the real default model.
"""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.modeling.default_model import ensure_default_model
from pagoda.errors import SchedulingPolicyError
from pagoda.plugins.schedulers.fcfs import FCFSPolicy
from pagoda.plugins.schedulers.priority import PriorityPolicy
from pagoda.registry.plugin_manager import get_plugin_manager
from pagoda.sequence import SequenceStatus
from scheduling_sim import (SimRunner, assert_kv_consistent, expected_output, make_request, make_scheduler,
                            run_until_done, step)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 5000) for _ in range(n)]


def test_both_policies_are_registered_under_their_names():
    pm = get_plugin_manager()
    assert pm.get("pagoda_schedulers", "fcfs", "scheduling_policy").factory is FCFSPolicy
    assert pm.get("pagoda_schedulers", "priority", "scheduling_policy").factory is PriorityPolicy


def test_fcfs_admits_in_arrival_order():
    s = make_scheduler("fcfs", max_num_seqs=1)
    for i, rid in enumerate(["b", "a", "c"]):
        s.add_request(make_request(rid, prompt(5, i), priority=-i, arrival=float(i)))
    order = []
    runner = SimRunner(64, 4)
    while s.has_unfinished_requests():
        sched = step(s, runner)
        order += [r.request_id for r in sched.requests if r.request_id not in order]
    assert order == ["b", "a", "c"]


class NewestFirst(FCFSPolicy):
    def order_waiting(self, waiting):
        return sorted(waiting, key=lambda r: -r.arrival_time)


class DropsOne(FCFSPolicy):
    def order_waiting(self, waiting):
        return waiting[1:]


def make_policy(cls, max_num_seqs: int = 8):
    """The scheduler make_scheduler builds, with the policy class ``cls``."""
    return make_scheduler(max_num_seqs=max_num_seqs, policy_cls=cls)


def test_order_waiting_decides_each_step_which_waiting_request_starts_first():
    s = make_policy(NewestFirst, max_num_seqs=1)
    for i, rid in enumerate(["a", "b", "c"]):
        s.add_request(make_request(rid, prompt(5, i), arrival=float(i)))
    order = []
    runner = SimRunner(64, 4)
    while s.has_unfinished_requests():
        sched = step(s, runner)
        order += [r.request_id for r in sched.requests if r.request_id not in order]
    assert order == ["c", "b", "a"]


def test_an_order_waiting_that_loses_a_request_is_refused_with_the_policy_s_name():
    s = make_policy(DropsOne)
    s.add_request(make_request("a", prompt(5)))
    s.add_request(make_request("b", prompt(5, 1)))
    with pytest.raises(SchedulingPolicyError, match="DropsOne policy's order_waiting returned 1 requests that are "
                                                    "not a reordering"):
        s.schedule()


def test_priority_admits_lower_values_first_then_earlier_arrivals_then_ids():
    s = make_scheduler("priority", max_num_seqs=1)
    s.add_request(make_request("late-low", prompt(5), priority=1, arrival=0.0))
    s.add_request(make_request("y", prompt(5), priority=0, arrival=2.0))
    s.add_request(make_request("x", prompt(5), priority=0, arrival=2.0))
    s.add_request(make_request("early", prompt(5), priority=0, arrival=1.0))
    assert [r.request_id for r in s.waiting] == ["early", "x", "y", "late-low"]


def test_every_request_gets_exactly_its_tokens():
    s = make_scheduler(num_blocks=64, budget=16)
    runner = SimRunner(64, 4)
    reqs = [make_request(f"r{i}", prompt(3 + 7 * i, i), max_tokens=5 + i) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    run_until_done(s, runner)
    for r in reqs:
        assert r.status == SequenceStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling_params.max_tokens)
    assert s.kv.num_free_blocks == 64


def test_a_step_never_exceeds_the_token_budget_or_max_num_seqs():
    s = make_scheduler(num_blocks=256, budget=20, max_num_seqs=3)
    runner = SimRunner(256, 4)
    for i in range(6):
        s.add_request(make_request(f"r{i}", prompt(30, i), max_tokens=6))
    while s.has_unfinished_requests():
        sched = step(s, runner)
        assert sched.num_batched_tokens <= 20 and len(sched.requests) <= 3


@pytest.mark.parametrize("threshold", [0, 3, 4, 9])
def test_chunked_prefill_splits_a_long_prompt_and_caps_each_chunk(threshold):
    s = make_scheduler(num_blocks=64, budget=16, long_prefill_token_threshold=threshold)
    runner = SimRunner(64, 4)
    req = make_request("long", prompt(50), max_tokens=3)
    s.add_request(req)
    chunks = []
    while not req.is_prefill_done:
        chunks.append(step(s, runner).num_new_tokens[0])
    assert sum(chunks) == 50 and max(chunks) == (threshold or 16)
    run_until_done(s, runner)
    assert req.output_token_ids == expected_output(req.prompt_token_ids, 3)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_prefill_only_request_finishes_when_its_prompt_is_computed_with_no_token_and_frees_its_blocks(policy):
    s = make_scheduler(policy, num_blocks=64, budget=16)
    runner = SimRunner(64, 4)
    scored = make_request("scored", prompt(40), max_tokens=0)
    beside = make_request("beside", prompt(10, 1), max_tokens=5)
    s.add_request(scored)
    s.add_request(beside)
    steps = []
    while not scored.is_finished:
        sched = s.schedule()
        progressed = s.update(sched, runner.execute(sched))
        steps.append(sched)
        assert scored not in progressed  # it gains no token
    assert sum(sched.num_new_tokens[sched.requests.index(scored)] for sched in steps if scored in sched.requests) == 40
    assert scored.status == SequenceStatus.FINISHED_LENGTH and scored.output_token_ids == []
    assert scored.num_computed_tokens == 40 and scored in s.drain_finished()
    run_until_done(s, runner)
    assert beside.output_token_ids == expected_output(beside.prompt_token_ids, 5)
    assert s.kv.num_free_blocks == 64


def test_without_chunked_prefill_a_prompt_is_scheduled_whole():
    s = make_scheduler(num_blocks=64, budget=32, chunked=False)
    runner = SimRunner(64, 4)
    s.add_request(make_request("a", prompt(20, 1), max_tokens=4))
    s.add_request(make_request("b", prompt(20, 2), max_tokens=4))
    first = step(s, runner)
    assert first.num_new_tokens == [20]  # b does not fit the rest of the budget and waits whole
    second = step(s, runner)
    assert sorted(second.num_new_tokens) == [1, 20]


def test_running_decodes_are_scheduled_before_prefill_chunks():
    s = make_scheduler(num_blocks=256, budget=16, long_prefill_token_threshold=8)
    runner = SimRunner(256, 4)
    s.add_request(make_request("long", prompt(100), max_tokens=2))
    for i in range(4):
        s.add_request(make_request(f"d{i}", prompt(2, i + 1), max_tokens=20))
    step(s, runner)  # long's first chunk, then the short prompts fill the budget
    assert [r.request_id for r in s.running] == ["long", "d0", "d1", "d2", "d3"]
    sched = step(s, runner)
    assert [r.request_id for r in sched.requests] == ["d0", "d1", "d2", "d3", "long"]
    assert sched.num_new_tokens == [1, 1, 1, 1, 8]


def test_a_4000_token_prompt_does_not_stall_32_running_decodes():
    budget = 512
    s = make_scheduler(num_blocks=2048, block_size=16, budget=budget, max_num_seqs=64)
    runner = SimRunner(2048, 16, check=False)
    decodes = [make_request(f"d{i}", prompt(40, i), max_tokens=200) for i in range(32)]
    for r in decodes:
        s.add_request(r)
    while not all(r.num_output_tokens for r in decodes):
        step(s, runner)
    long = make_request("long", prompt(4000, 99), max_tokens=4)
    s.add_request(long)
    # a step costs about its number of batched tokens; a decode waits at most one step's budget
    while not long.num_output_tokens:
        before = {r.request_id: r.num_output_tokens for r in decodes}
        sched = step(s, runner)
        assert sched.num_batched_tokens <= budget
        assert all(r.num_output_tokens == before[r.request_id] + 1 for r in decodes)
    assert long.num_computed_tokens == 4000


def test_a_request_that_outgrows_the_whole_cache_fails_with_a_clear_error():
    s = make_scheduler(num_blocks=4, block_size=4, budget=32)
    runner = SimRunner(4, 4)
    req = make_request("big", prompt(10), max_tokens=20)  # fits at first, needs 8 blocks by the end
    other = make_request("small", prompt(3, 5), max_tokens=2)
    s.add_request(req)
    s.add_request(other)
    run_until_done(s, runner)
    assert req.status == SequenceStatus.FINISHED_ERROR
    assert "needs 5 KV blocks" in req.error and "whole cache has 4" in req.error
    assert other.status == SequenceStatus.FINISHED_LENGTH
    assert s.kv.num_free_blocks == 4


def test_a_waiting_prompt_larger_than_the_cache_is_rejected_not_starved():
    s = make_scheduler(num_blocks=4, block_size=4, budget=64)
    s.add_request(make_request("big", prompt(40), max_tokens=2))
    step(s, SimRunner(4, 4))
    [failed] = s.drain_finished()
    assert failed.status == SequenceStatus.FINISHED_ERROR and "raise --kv-cache-memory-bytes" in failed.error
    assert not s.has_unfinished_requests()


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "swapped", "preempted"])
def test_abort_in_any_state_frees_every_block_at_once(state):
    mode = "swap" if state == "swapped" else "recompute"
    s = make_scheduler(num_blocks=8, block_size=4, budget=8, preemption_mode=mode, num_swap_blocks=16)
    runner = SimRunner(8, 4, 16)
    hog = make_request("hog", prompt(13, 2), max_tokens=12)  # grows to 7 of the 8 blocks
    victim = make_request("v", prompt(12, 1), max_tokens=4)
    if state in ("swapped", "preempted"):
        s.add_request(hog)
        while not hog.num_output_tokens:
            step(s, runner)
    s.add_request(victim)
    if state == "prefilling":
        step(s, runner)
        assert 0 < victim.num_computed_tokens < 12
    if state in ("decoding", "swapped", "preempted"):
        while not victim.num_output_tokens:
            step(s, runner)
    if state in ("swapped", "preempted"):
        while victim.status == SequenceStatus.RUNNING:
            step(s, runner)
        assert victim.status == (SequenceStatus.SWAPPED if state == "swapped" else SequenceStatus.PREEMPTED)
        s.abort_requests(["hog"])
    assert s.abort_requests(["v"]) == [victim]
    assert victim.status == SequenceStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks == 8 and s.kv.num_free_swap_blocks == 16
    assert not s.has_unfinished_requests()
    assert_kv_consistent(s.kv)


def test_n_sequences_share_the_prompt_blocks_and_copy_only_the_partial_one():
    s = make_scheduler(num_blocks=64, block_size=4, budget=64)
    runner = SimRunner(64, 4)
    shared_prompt = prompt(10)
    children = [make_request(f"p-{i}", shared_prompt, max_tokens=3, n=3, parent_id="p") for i in range(3)]
    for c in children:
        s.add_request(c)
    first = step(s, runner)
    assert [r.request_id for r in first.requests] == ["p-0"]  # siblings wait for the shared prompt
    second = step(s, runner)
    fork_tokens = {r.request_id: n for r, n in zip(second.requests, second.num_new_tokens)}
    assert fork_tokens == {"p-0": 1, "p-1": 1, "p-2": 1}
    assert len(second.blocks_to_copy) == 2  # one private copy of the partial block per sibling
    tables = [s.kv.block_table(c.request_id) for c in children]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    run_until_done(s, runner)
    for c in children:
        assert c.output_token_ids == expected_output(shared_prompt, 3)
    assert s.kv.num_free_blocks == 64


# ---- chunked prefill with the real default model -------------------------------------------------

CHUNK_PROMPTS = [[random.Random(50 + i).randrange(1000, 30000) for _ in range(n)] for i, n in enumerate((70, 33, 49))]
CHUNK_PARAMS = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True),
                SamplingParams(temperature=0.7, top_p=0.9, seed=6, max_tokens=8, ignore_eos=True)]


def generate_with(**kwargs) -> list[list[int]]:
    ensure_default_model()
    llm = LLM(dtype="bfloat16", batch_invariant=True,
              max_model_len=128, kv_cache_memory_bytes=16 << 20, cpu_threads=1, max_num_seqs=4,
              **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in CHUNK_PROMPTS], CHUNK_PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def whole_prompt_tokens():
    return generate_with(enable_chunked_prefill=False, max_num_batched_tokens=128)


@pytest.mark.slow
@pytest.mark.parametrize("budget, threshold", [(24, 0), (40, 7), (64, 16)])
def test_chunked_prefill_generates_the_same_tokens_as_whole_prompts(whole_prompt_tokens, budget, threshold):
    # chunks of 24 and 7 tokens end inside a 16-token block; 16 ends on block boundaries
    assert generate_with(max_num_batched_tokens=budget, long_prefill_token_threshold=threshold) == whole_prompt_tokens


# ---- memory: KV waste at the peak of W1 ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("block_size, bound", [(16, 0.05), (8, 0.025)])
def test_kv_waste_at_the_peak_of_w1_is_only_each_request_s_last_block_tail(block_size, bound):
    from pagoda.engine.components import load_tokenizer
    from pagoda.plugins.entrypoints.bench.workloads import random_64

    tokenizer = load_tokenizer(str(ensure_default_model()), None)
    workload = random_64(49152, set(tokenizer.all_special_ids))
    # the engine's defaults: 2,048-token steps, 256 sequences, a cache that holds all of W1
    s = make_scheduler(num_blocks=8192 // block_size * 16, block_size=block_size, budget=2048, max_num_seqs=256,
                       max_model_len=2048)
    runner = SimRunner(s.kv.num_blocks, block_size, check=False)
    for i, r in enumerate(workload):
        s.add_request(make_request(f"w1-{i}", r.prompt_token_ids, r.output_len))
    peak_held, peak_slots = 0, 0
    while s.has_unfinished_requests():
        step(s, runner)
        held, slots = s.kv.token_occupancy()
        assert slots - held <= (block_size - 1) * len(s.running)  # at most one partly filled block each
        if slots > peak_slots:
            peak_held, peak_slots = held, slots
    waste = 1 - peak_held / peak_slots
    print(f"W1 peak, block size {block_size}: {peak_held} tokens in {peak_slots} slots, waste {waste:.2%}")
    assert waste < bound


def test_schedule_records_a_failure_and_update_commits_it():
    s = make_scheduler(num_blocks=4, block_size=4, budget=64)
    big = make_request("big", prompt(40), max_tokens=2)
    s.add_request(big)
    sched = s.schedule()
    # decided, not done: the request left the queues, but only update() ends it
    assert [r for r, _ in sched.failed] == [big] and "raise --kv-cache-memory-bytes" in sched.failed[0][1]
    assert not big.is_finished and big.error is None and not s.has_unfinished_requests()
    s.update(sched, SimRunner(4, 4).execute(sched))
    assert big.status == SequenceStatus.FINISHED_ERROR and big.error == sched.failed[0][1]
    assert s.drain_finished() == [big] and s.kv.num_free_blocks == 4


def test_a_request_preempted_by_recompute_keeps_its_progress_until_update():
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    runner = SimRunner(6, 4)
    a, b = make_request("a", prompt(10, 1), max_tokens=8), make_request("b", prompt(10, 2), max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    while True:
        before = {r.request_id: r.num_computed_tokens for r in (a, b)}
        sched = s.schedule()
        assert {r.request_id: r.num_computed_tokens for r in (a, b)} == before  # schedule() writes no progress
        if sched.preempted:
            break
        s.update(sched, runner.execute(sched))
    [victim] = sched.preempted
    assert victim.num_computed_tokens > 0 and victim not in sched.requests  # not started again in this step
    s.update(sched, runner.execute(sched))
    assert victim.num_computed_tokens == 0 and victim.status == SequenceStatus.PREEMPTED
    run_until_done(s, runner)
    for r in (a, b):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 8)
