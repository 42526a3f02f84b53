"""The offload tiers' books (pagoda.kv.tiers) with the paged allocator and the fcfs scheduler, no model: a
simulated runner that keeps the token id in every KV slot, RAM slot and block file checks that every
sequence attends to its own tokens, whatever the tiers moved."""

from __future__ import annotations

import random

import pytest

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv.blocks import PagedKVCacheManager, hash_block
from pagoda.kv.tiers import KVTierIndex
from pagoda.plugins.schedulers.priority import PriorityPolicy
from pagoda.scheduling import Scheduler
from pagoda.sampling_params import SamplingParams
from pagoda.sequence import Sequence, SequenceStatus
from pagoda.testing.scheduling import SimRunner, check_kv_allocator, check_scheduler, expected_output

BS = 4


def key_of(i: int) -> tuple:
    return (None, (i, i, i, i), ())


def offload(index: KVTierIndex, i: int, block_id: int = 0) -> None:
    index.offload(hash_block(*key_of(i)), key_of(i), block_id)


def where(index: KVTierIndex, i: int):
    return index.lookup(hash_block(*key_of(i)), key_of(i))


def test_evicted_blocks_fill_ram_then_disk_and_the_least_recently_used_go_first():
    index = KVTierIndex(num_ram_slots=2, num_disk_blocks=2, bytes_per_block=100)
    for i in range(5):
        offload(index, i, block_id=i)
        index.take_moves()
    # RAM keeps the two newest; the next two moved down to disk; the oldest fell off the end
    assert [where(index, i) for i in range(5)] == [None, "disk", "disk", "ram", "ram"]
    assert index.stats.num_ram_blocks == 2 and index.stats.num_disk_blocks == 2
    assert index.stats.ram.stored_bytes == 500 and index.stats.disk.stored_bytes == 300


def test_a_step_s_moves_name_each_slot_and_file_in_runner_order():
    index = KVTierIndex(num_ram_slots=1, num_disk_blocks=1, bytes_per_block=1)
    offload(index, 0, block_id=7)
    assert index.take_moves().blocks_to_ram == [(7, 0)]
    offload(index, 1, block_id=8)  # block 0 moves down to disk before its slot takes block 1
    moves = index.take_moves()
    h0, h1 = hash_block(*key_of(0)), hash_block(*key_of(1))
    assert moves.ram_to_disk == [(0, h0, key_of(0))] and moves.blocks_to_ram == [(8, 0)]
    offload(index, 2, block_id=9)  # the disk holds one file: block 0's is deleted for block 1's
    moves = index.take_moves()
    assert moves.files_to_delete == [h0] and moves.ram_to_disk == [(0, h1, key_of(1))]
    assert index.load(h1, key_of(1), 3) == "disk"
    assert index.take_moves().disk_to_blocks == [(h1, 3)]
    assert index.stats.disk.hits == 1


def test_a_slot_read_this_step_is_never_reused_in_the_same_step():
    index = KVTierIndex(num_ram_slots=1, num_disk_blocks=0, bytes_per_block=1)
    offload(index, 0, block_id=5)
    index.take_moves()
    h0 = hash_block(*key_of(0))
    index.load(h0, key_of(0), 6)
    offload(index, 1, block_id=7)  # the only slot is being read: block 1 is not kept
    moves = index.take_moves()
    assert moves.ram_to_blocks == [(0, 6)] and not moves.blocks_to_ram
    assert where(index, 0) == "ram" and where(index, 1) is None


def test_disk_entries_found_at_start_beyond_the_limit_are_not_indexed():
    found = [(hash_block(*key_of(i)), key_of(i)) for i in range(4)]
    index = KVTierIndex(num_ram_slots=0, num_disk_blocks=3, bytes_per_block=1, disk_entries=found)
    assert index.holds("disk") == [h for h, _ in found[:3]]


def test_negative_tier_sizes_are_refused():
    with pytest.raises(ValueError, match=">= 0"):
        KVTierIndex(-1, 0, 1)


def tiered(ram: int, disk: int):
    def factory(cache_config: CacheConfig, num_blocks: int) -> PagedKVCacheManager:
        kv = PagedKVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        kv.init_offload(KVTierIndex(ram, disk, 64))
        return kv
    return factory


@pytest.mark.parametrize("ram,disk", [(3, 4), (0, 3), (2, 0)])
def test_the_allocator_with_tiers_passes_the_conformance_kit(ram, disk):
    check_kv_allocator(tiered(ram, disk), seeds=2)


def test_the_priority_scheduler_over_tiers_passes_the_conformance_kit():
    check_scheduler(PriorityPolicy, allocator=tiered(2, 3), seeds=2)


def test_a_stopping_engine_s_spill_writes_pool_and_ram_blocks_to_disk_once():
    kv = PagedKVCacheManager(4, BS)
    kv.init_offload(KVTierIndex(num_ram_slots=1, num_disk_blocks=8, bytes_per_block=1))
    for i, tokens in enumerate(([1] * 9, [2] * 9, [3] * 9)):  # two full blocks each; 4 pool blocks in all
        seq = Sequence(f"s{i}", tokens, SamplingParams(max_tokens=1))
        blocks, _ = kv.get_computed_blocks(seq)
        assert kv.allocate_slots(seq, len(tokens), blocks)
        kv.free(seq)
    kv.take_tier_moves()
    on_disk = set(kv.tiers.holds("disk"))
    moves = kv.spill_to_disk()
    # the RAM entry and the cached pool blocks not on disk yet go there, each once
    written = [h for _, h, _ in moves.ram_to_disk] + [h for _, h, _ in moves.blocks_to_disk]
    assert len(written) == len(set(written)) and not on_disk & set(written)
    assert set(kv.tiers.holds("disk")) == on_disk | set(written)
    assert set(kv.tiers.holds("ram")) | set(kv._cached) <= set(kv.tiers.holds("disk"))
    assert len(moves.blocks_to_disk) == len(set(kv._cached) - on_disk) > 0
    assert not kv.spill_to_disk()  # a second spill finds everything on disk already


def run_stream(kv: PagedKVCacheManager, seed: int, preemption_mode: str, num_blocks: int = 16) -> None:
    """Many prefixes over a pool that holds few: prefixes evict each other and come back from the tiers."""
    rng = random.Random(seed)
    swap = 8 if preemption_mode == "swap" else 0
    kv.init_swap_pool(swap)
    sched_cfg = SchedulerConfig("fcfs", 4, 16, 200, True, 0, None)
    cache_cfg = CacheConfig(BS, 0, "auto", True, num_blocks, 0, preemption_mode, "paged")
    scheduler, runner = Scheduler(sched_cfg, cache_cfg, kv), SimRunner(num_blocks, BS, swap)
    prefixes = [[rng.randrange(100, 5000) for _ in range(12)] for _ in range(6)]
    added = []
    for step in range(3000):
        if len(added) < 60 and rng.random() < 0.5:
            ids = rng.choice(prefixes) + [rng.randrange(100, 5000) for _ in range(rng.randrange(1, 9))]
            seq = Sequence(f"r{len(added)}", ids, SamplingParams(max_tokens=rng.randrange(1, 6), ignore_eos=True))
            scheduler.add_request(seq)
            added.append(seq)
        if scheduler.has_unfinished_requests():
            sched = scheduler.schedule()
            scheduler.update(sched, runner.execute(sched))
        elif len(added) >= 60:
            break
    for seq in added:
        assert seq.status == SequenceStatus.FINISHED_LENGTH
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, seq.sampling_params.max_tokens)
    assert kv.num_free_blocks == num_blocks


@pytest.mark.parametrize("ram,disk", [(3, 5), (0, 6), (4, 0), (1, 2)])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_prefixes_evicting_each_other_come_back_from_the_tiers_with_their_own_tokens(ram, disk, preemption_mode):
    hits = {"ram": 0, "disk": 0}
    for seed in range(3):
        kv = PagedKVCacheManager(16, BS)
        kv.init_offload(KVTierIndex(ram, disk, 64))
        run_stream(kv, seed, preemption_mode)
        hits["ram"] += kv.tiers.stats.ram.hits
        hits["disk"] += kv.tiers.stats.disk.hits
    assert (hits["ram"] > 0) == (ram > 0) and (hits["disk"] > 0) == (disk > 0), hits
