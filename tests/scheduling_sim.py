"""Scheduler and KV manager tests without a model: ``SimRunner`` (from the conformance kit, pagoda.testing)
keeps the token id written into every KV slot and checks each sequence attends to its own tokens."""

from __future__ import annotations

from typing import Optional

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv.blocks import PagedKVCacheManager, hash_block
from pagoda.plugins.schedulers.fair import FairPolicy
from pagoda.plugins.schedulers.fcfs import FCFSPolicy
from pagoda.plugins.schedulers.priority import PriorityPolicy
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling import Scheduler
from pagoda.sequence import Sequence
from pagoda.step import SchedulerOutput
from pagoda.testing import SimRunner, expected_output, next_token  # noqa: F401 - used by the tests

POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy, "fair": FairPolicy}


def make_scheduler(policy: str = "fcfs", num_blocks: int = 64, block_size: int = 4, budget: int = 32,
                   max_num_seqs: int = 8, chunked: bool = True, long_prefill_token_threshold: int = 0,
                   prefix_caching: bool = True, preemption_mode: str = "recompute", num_swap_blocks: int = 0,
                   max_model_len: int = 8192, policy_cls=None, **options) -> Scheduler:
    """The scheduler with the policy named ``policy`` (or the class ``policy_cls``) and its ``options``."""
    sched_cfg = SchedulerConfig(policy, max_num_seqs, budget, max_model_len, chunked, long_prefill_token_threshold,
                                None)
    cache_cfg = CacheConfig(block_size, 0, "auto", prefix_caching, num_blocks, 0, preemption_mode, "paged")
    kv = PagedKVCacheManager(num_blocks, block_size, prefix_caching, num_swap_blocks)
    return Scheduler(sched_cfg, cache_cfg, kv, policy_cls or POLICIES[policy], options)


def make_request(rid: str, prompt: list[int], max_tokens: int = 4, priority: int = 0, arrival: float = 0.0,
                 n: int = 1, parent_id: Optional[str] = None) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
    return Sequence(rid, prompt, params, None, arrival, None, priority, parent_id=parent_id)


def assert_prefix_cache_matches_contents(runner: SimRunner, kv: PagedKVCacheManager) -> None:
    """Every block in the prefix cache holds exactly the tokens its key says."""
    for h, block in kv._cached.items():
        assert block.block_hash == h and hash_block(*block.key) == h
        assert tuple(runner.cache[block.block_id]) == block.key[1], f"cached block {block.block_id} is stale"


def step(scheduler, runner: SimRunner) -> SchedulerOutput:
    """One engine step without a model: schedule, execute, update."""
    sched = scheduler.schedule()
    sampled = runner.execute(sched)
    scheduler.update(sched, sampled)
    return sched


def assert_kv_consistent(kv: PagedKVCacheManager) -> None:
    """Ref counts equal table references; free blocks and swap slots are exactly the unused ones."""
    refs = [0] * kv.num_blocks
    for table in kv._tables.values():
        for block in table:
            refs[block.block_id] += 1
    assert [b.ref_cnt for b in kv.blocks] == refs
    # the block ids block_table hands out are the tables' own
    assert {rid: kv.block_table(rid) for rid in kv._tables} == {
        rid: [b.block_id for b in table] for rid, table in kv._tables.items()}
    assert kv._block_ids.keys() == kv._tables.keys()
    assert set(kv._free) == {b.block_id for b in kv.blocks if b.ref_cnt == 0}
    used_swap = [s for slots in kv._swapped.values() for s in slots]
    assert len(used_swap) == len(set(used_swap))
    assert sorted(used_swap + kv._free_swap) == list(range(kv.num_swap_blocks))


def run_until_done(scheduler, runner: SimRunner, max_steps: int = 10_000) -> int:
    steps = 0
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
        steps += 1
        assert steps < max_steps, "requests never finish"
    return steps
