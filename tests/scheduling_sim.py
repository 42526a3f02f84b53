"""A model-free stand-in for the runner, for scheduler and KV manager tests.

``SimRunner`` keeps, per KV block, the token id written into each slot (and
the same for swap slots), performs the block moves of a schedule, writes the
scheduled tokens into their slots and checks that every request's context in
its block table is exactly its own tokens: the property the real attention
relies on. Its "model" samples a token that is a pure function of that context.
"""

from __future__ import annotations

from typing import Optional

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv_blocks import PagedKVCacheManager
from pagoda.plugins.schedulers.base import FCFSScheduler
from pagoda.plugins.schedulers.priority import PriorityScheduler
from pagoda.sequence import Sequence
from pagoda.sampling_params import SamplingParams
from pagoda.step import RunnerOutput, SchedulerOutput

POLICIES = {"fcfs": FCFSScheduler, "priority": PriorityScheduler}


def make_scheduler(policy: str = "fcfs", num_blocks: int = 64, block_size: int = 4, budget: int = 32,
                   max_num_seqs: int = 8, chunked: bool = True, long_prefill_token_threshold: int = 0,
                   prefix_caching: bool = True, preemption_mode: str = "recompute", num_swap_blocks: int = 0,
                   max_model_len: int = 8192):
    sched_cfg = SchedulerConfig(policy, max_num_seqs, budget, max_model_len, chunked, long_prefill_token_threshold,
                                None)
    cache_cfg = CacheConfig(block_size, 0, "auto", prefix_caching, num_blocks, 0, preemption_mode, "paged")
    kv = PagedKVCacheManager(num_blocks, block_size, prefix_caching, num_swap_blocks)
    return POLICIES[policy](sched_cfg, cache_cfg, kv)


def make_request(rid: str, prompt: list[int], max_tokens: int = 4, priority: int = 0, arrival: float = 0.0,
                 n: int = 1, parent_id: Optional[str] = None) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
    return Sequence(rid, prompt, params, None, arrival, None, priority, parent_id=parent_id)


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic token id from the whole context."""
    h = len(context)
    for t in context[-6:]:
        h = (h * 1000003 + t) & 0xFFFFFFFF
    return 100 + h % 5000


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class SimRunner:
    """Executes schedules on simulated KV contents (token ids per slot)."""

    def __init__(self, num_blocks: int, block_size: int, num_swap_blocks: int = 0, check: bool = True) -> None:
        self.block_size = block_size
        self.cache: list[list[Optional[int]]] = [[None] * block_size for _ in range(num_blocks)]
        self.swap: list[list[Optional[int]]] = [[None] * block_size for _ in range(num_swap_blocks)]
        self.check = check

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        for block, slot in sched.blocks_to_swap_out:
            self.swap[slot] = list(self.cache[block])
        for slot, block in sched.blocks_to_swap_in:
            self.cache[block] = list(self.swap[slot])
        for src, dst in sched.blocks_to_copy:
            self.cache[dst] = list(self.cache[src])
        bs = self.block_size
        # every layer writes the whole step's K/V before any request attends
        for req, table, start, n in zip(sched.requests, sched.block_tables, sched.num_computed_before,
                                        sched.num_new_tokens):
            for pos in range(start, start + n):
                self.cache[table[pos // bs]][pos % bs] = req.all_token_ids[pos]
        sampled = []
        for req, table, start, n in zip(sched.requests, sched.block_tables, sched.num_computed_before,
                                        sched.num_new_tokens):
            seq_len = start + n
            if self.check:
                context = [self.cache[table[p // bs]][p % bs] for p in range(seq_len)]
                assert context == req.all_token_ids[:seq_len], f"{req.request_id} attends to wrong KV"
            else:
                context = req.all_token_ids[:seq_len]
            sampled.append([next_token(context)] if seq_len == req.num_tokens else [])
        n = len(sampled)
        return RunnerOutput(sampled, [None] * n, [None] * n, [0] * n)

    def assert_prefix_cache_matches_contents(self, kv: PagedKVCacheManager) -> None:
        for h, block in kv._cached.items():
            assert block.block_hash == h and hash(block.key) == h
            assert tuple(self.cache[block.block_id]) == block.key[1], f"cached block {block.block_id} is stale"


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
