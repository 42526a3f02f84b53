"""The paged KV allocator alone: block accounting, the prefix cache, copy-on-write, the swap pool."""

from __future__ import annotations

import random

import pytest

from pagoda.kv.blocks import PagedKVCacheManager, hash_block
from pagoda.sampling_params import SamplingParams
from pagoda.sequence import Sequence
from scheduling_sim import assert_kv_consistent

BS = 4


def make_request(rid: str, token_ids: list[int]) -> Sequence:
    return Sequence(rid, list(token_ids), SamplingParams(max_tokens=8))


def admit(kv: PagedKVCacheManager, req: Sequence, num_new: int | None = None) -> int:
    """What a scheduler does on first admission: reuse the cached prefix, allocate the rest."""
    blocks, num_cached = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_cached if num_new is None else num_new
    assert kv.allocate_slots(req, num_new, blocks)
    req.num_computed_tokens = num_cached + num_new
    return num_cached


def assert_consistent(kv: PagedKVCacheManager) -> None:
    """Ref counts, free blocks and swap slots add up; every cached block sits under its own hash."""
    assert_kv_consistent(kv)
    for h, block in kv._cached.items():
        assert block.block_hash == h and hash_block(*block.key) == h


def test_allocation_takes_whole_blocks_and_free_returns_them():
    kv = PagedKVCacheManager(8, BS)
    req = make_request("a", range(10))
    admit(kv, req)
    assert kv.num_blocks_held("a") == 3 and kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)
    kv.free(req)
    assert kv.num_free_blocks == 8 and kv.usage == 0.0
    assert_consistent(kv)


def test_allocate_slots_refuses_rather_than_allocating_partially():
    kv = PagedKVCacheManager(2, BS, enable_prefix_caching=False)
    req = make_request("a", range(9))
    assert not kv.can_allocate(req, 9)
    assert not kv.allocate_slots(req, 9)
    assert kv.num_free_blocks == 2 and kv.block_table("a") == []


def test_a_request_with_the_same_prefix_reuses_every_full_cached_block():
    kv = PagedKVCacheManager(16, BS)
    first = make_request("a", range(10))
    admit(kv, first)
    second = make_request("b", list(range(8)) + [50, 51, 52])
    assert admit(kv, second) == 8
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2] != kv.block_table("a")[2]
    assert_consistent(kv)


def test_a_fully_cached_prompt_still_leaves_one_token_to_compute():
    kv = PagedKVCacheManager(16, BS)
    admit(kv, make_request("a", range(8)))
    blocks, num_cached = kv.get_computed_blocks(make_request("b", range(8)))
    assert num_cached == 4 and len(blocks) == 1


def test_the_hash_chain_makes_a_block_depend_on_everything_before_it():
    kv = PagedKVCacheManager(16, BS)
    admit(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # the second block's tokens match, the first block's do not: no hit at all
    _, num_cached = kv.get_computed_blocks(make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert num_cached == 0


def test_a_hash_hit_is_confirmed_against_the_stored_tokens():
    kv = PagedKVCacheManager(16, BS)
    admit(kv, make_request("a", range(9)))
    block = kv.blocks[kv.block_table("a")[0]]
    # a colliding hash whose block holds other tokens must not be reused
    block.key = (None, (9, 9, 9, 9), ())
    _, num_cached = kv.get_computed_blocks(make_request("b", range(9)))
    assert num_cached == 0


def test_freed_cached_blocks_stay_reusable_until_the_pool_needs_them():
    kv = PagedKVCacheManager(4, BS)
    a = make_request("a", range(9))
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    assert admit(kv, make_request("b", range(9))) == 8
    assert kv.stats.hits == 8 and kv.stats.queries == 18


def test_eviction_takes_uncached_blocks_first_then_the_least_recently_freed():
    kv = PagedKVCacheManager(6, BS)
    a, b = make_request("a", range(100, 109)), make_request("b", range(200, 209))
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)
    # 2 uncached tail blocks go first, then a's blocks (freed before b's), last block first
    admit(kv, make_request("c", range(300, 310)))
    _, cached_a = kv.get_computed_blocks(make_request("a2", range(100, 109)))
    _, cached_b = kv.get_computed_blocks(make_request("b2", range(200, 209)))
    assert (cached_a, cached_b) == (4, 8)
    assert_consistent(kv)


class LeastHitFirst(PagedKVCacheManager):
    """Evicts the cached block with the fewest prefix hits first."""

    def eviction_key(self, block):
        return block.num_hits


def test_eviction_key_orders_the_cached_blocks_to_overwrite_and_hits_are_counted_per_contents():
    kv = LeastHitFirst(6, BS)
    a, b = make_request("a", range(100, 109)), make_request("b", range(200, 209))
    admit(kv, a)
    admit(kv, b)
    kv.free(b)
    for i in range(3):  # b's prefix is reused three times; a's never
        again = make_request(f"b{i}", range(200, 209))
        assert admit(kv, again) == 8
        kv.free(again)
    kv.free(a)  # freed last: LRU would overwrite b's blocks first
    admit(kv, make_request("c", range(300, 310)))  # 2 uncached blocks, then the 1 least-hit cached block
    assert kv.get_computed_blocks(make_request("a2", range(100, 109)))[1] == 4
    assert kv.get_computed_blocks(make_request("b2", range(200, 209)))[1] == 8
    admit(kv, make_request("d", range(400, 404)))  # a's other block, still fewer hits than b's
    assert kv.get_computed_blocks(make_request("a3", range(100, 109)))[1] == 0
    assert kv.get_computed_blocks(make_request("b3", range(200, 209)))[1] == 8
    assert_consistent(kv)
    assert all(b.num_hits == 0 for b in kv.blocks if b.block_hash is None)  # overwritten: the count restarts


def test_keyed_eviction_survives_hits_on_free_blocks_and_a_prefix_cache_reset():
    rng = random.Random(0)
    kv = LeastHitFirst(12, BS)
    live: list[Sequence] = []
    for i in range(300):
        if live and rng.random() < 0.45:
            kv.free(live.pop(rng.randrange(len(live))))
        elif rng.random() < 0.02:
            kv.reset_prefix_cache()
        else:
            req = make_request(f"r{i}", [rng.randrange(3) for _ in range(rng.randrange(1, 14))])
            blocks, _ = kv.get_computed_blocks(req)
            if kv.can_allocate(req, req.num_tokens - len(blocks) * BS, blocks):
                admit(kv, req)
                live.append(req)
        assert_consistent(kv)


def test_disabled_prefix_caching_neither_hits_nor_counts():
    kv = PagedKVCacheManager(8, BS, enable_prefix_caching=False)
    admit(kv, make_request("a", range(9)))
    assert admit(kv, make_request("b", range(9))) == 0
    assert kv.stats.queries == 0 and kv.stats.hits == 0


def test_reset_prefix_cache_forgets_every_block():
    kv = PagedKVCacheManager(8, BS)
    admit(kv, make_request("a", range(9)))
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", range(9)))[1] == 0
    assert_consistent(kv)


def test_a_forked_sequence_shares_blocks_and_copies_the_partial_one_on_first_write():
    kv = PagedKVCacheManager(8, BS)
    leader, child = make_request("p-0", range(10)), make_request("p-1", range(10))
    admit(kv, leader)
    kv.fork(leader, child, 9)
    assert kv.block_table("p-1") == kv.block_table("p-0")
    assert kv.num_free_blocks == 5  # nothing copied yet
    child.num_computed_tokens = 9
    assert kv.num_blocks_to_take(child, 1) == 1
    assert kv.allocate_slots(child, 1)
    leader_table, child_table = kv.block_table("p-0"), kv.block_table("p-1")
    assert child_table[:2] == leader_table[:2] and child_table[2] != leader_table[2]
    assert kv.take_block_copies() == [(leader_table[2], child_table[2])]
    assert kv.take_block_copies() == []
    assert_consistent(kv)
    kv.free(leader)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_writing_into_a_block_only_one_request_holds_copies_nothing():
    kv = PagedKVCacheManager(8, BS)
    req = make_request("a", range(6))
    admit(kv, req)
    req.append_output_tokens([7], 1 << 20)
    assert kv.allocate_slots(req, 1)
    assert kv.take_block_copies() == []


def test_swap_out_and_in_moves_every_block_and_restores_the_table_length():
    kv = PagedKVCacheManager(8, BS, enable_prefix_caching=False, num_swap_blocks=4)
    req = make_request("a", range(10))
    admit(kv, req)
    table = kv.block_table("a")
    assert kv.can_swap_out(req)
    out_pairs = kv.swap_out(req)
    assert [b for b, _ in out_pairs] == table
    assert kv.num_free_blocks == 8 and kv.num_free_swap_blocks == 1 and kv.is_swapped("a")
    assert kv.can_swap_in(req, 1)
    in_pairs = kv.swap_in(req)
    assert [s for s, _ in in_pairs] == [s for _, s in out_pairs]
    assert [b for _, b in in_pairs] == kv.block_table("a")
    assert kv.num_free_swap_blocks == 4 and kv.num_free_blocks == 5
    assert_consistent(kv)


def test_swap_in_shares_blocks_still_in_the_prefix_cache_instead_of_copying():
    kv = PagedKVCacheManager(8, BS, num_swap_blocks=4)
    req = make_request("a", range(10))
    admit(kv, req)
    kv.swap_out(req)
    in_pairs = kv.swap_in(req)
    # the two full blocks were still cached: only the partial third one is copied back
    assert len(in_pairs) == 1 and kv.num_blocks_held("a") == 3
    assert_consistent(kv)


def test_swap_out_needs_a_free_swap_slot_per_block():
    kv = PagedKVCacheManager(8, BS, num_swap_blocks=2)
    req = make_request("a", range(10))
    admit(kv, req)
    assert not kv.can_swap_out(req)


def test_freeing_a_swapped_request_returns_its_swap_slots():
    kv = PagedKVCacheManager(8, BS, num_swap_blocks=4)
    req = make_request("a", range(10))
    admit(kv, req)
    kv.swap_out(req)
    kv.free(req)
    assert kv.num_free_swap_blocks == 4 and not kv.is_swapped("a") and kv.num_free_blocks == 8


def test_token_occupancy_counts_the_unfilled_tail_of_each_last_block():
    kv = PagedKVCacheManager(16, BS)
    admit(kv, make_request("a", range(10)))  # 3 blocks, 10 tokens
    admit(kv, make_request("b", range(100, 105)))  # 2 blocks, 5 tokens
    assert kv.token_occupancy() == (15, 20)


def test_token_occupancy_counts_a_shared_block_once():
    kv = PagedKVCacheManager(16, BS)
    admit(kv, make_request("a", range(9)))
    admit(kv, make_request("b", range(9)))  # shares a's two full blocks
    assert kv.token_occupancy() == (8 + 1 + 1, 16)


def test_allocation_takes_exactly_the_blocks_predicted_and_block_tables_follow_every_change():
    # a seeded random mix of admissions (with prefix hits), growth, forks (copy-on-write), draft slots
    # trimmed back, swaps and frees; after each one the pool adds up, block_table matches the table, and
    # a growing request took as many blocks as num_blocks_to_take said (the allocator's fast path)
    rng = random.Random(0)
    kv = PagedKVCacheManager(24, BS, num_swap_blocks=8)
    running: list[Sequence] = []
    swapped: list[Sequence] = []
    prompts = [list(range(i, i + 11)) for i in (0, 0, 3, 40)]  # repeats: prefix hits
    for n in range(600):
        op = rng.choice(["admit", "grow", "grow", "grow", "fork", "drafts", "swap", "free"])
        if op == "admit" or not running:
            req = make_request(f"r{n}", rng.choice(prompts)[:rng.randint(2, 11)])
            blocks, num_cached = kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_cached
            predicted, free_before = kv.num_blocks_to_take(req, num_new, blocks), kv.num_free_blocks
            assert kv.allocate_slots(req, num_new, blocks) == (predicted <= free_before)
            if predicted <= free_before:
                assert free_before - kv.num_free_blocks == predicted
                req.num_computed_tokens = req.num_tokens
                running.append(req)
        elif op == "grow":
            req = rng.choice(running)
            req.append_output_tokens([rng.randrange(50)], 1 << 20)
            num_new = req.num_tokens - req.num_computed_tokens + rng.choice([0, 0, 3])
            predicted, free_before = kv.num_blocks_to_take(req, num_new), kv.num_free_blocks
            assert kv.allocate_slots(req, num_new) == (predicted <= free_before)
            if predicted <= free_before:
                assert free_before - kv.num_free_blocks == predicted
                req.num_computed_tokens = req.num_tokens
                kv.trim_slots(req, req.num_tokens)
            else:
                req.output_token_ids.pop()
                req.all_token_ids.pop()
        elif op == "fork":
            leader = rng.choice(running)
            child = make_request(f"r{n}", leader.all_token_ids)
            kv.fork(leader, child, leader.num_tokens - 1)
            child.num_computed_tokens = leader.num_tokens - 1
            if kv.allocate_slots(child, 1):
                child.num_computed_tokens = child.num_tokens
                running.append(child)
            else:
                kv.free(child)
        elif op == "drafts":
            req = rng.choice(running)
            if kv.allocate_slots(req, 1 + rng.randint(1, 6)):
                kv.trim_slots(req, req.num_tokens)
        elif op == "swap" and swapped and kv.can_swap_in(swapped[0], 0):
            req = swapped.pop(0)
            kv.swap_in(req)
            running.append(req)
        elif op == "swap" and kv.can_swap_out(running[-1]):
            swapped.append(running.pop())
            kv.swap_out(swapped[-1])
        elif op == "free":
            kv.free(running.pop(rng.randrange(len(running))))
        assert_consistent(kv)
        for req in running:
            assert kv.block_table(req.request_id) == [b.block_id for b in kv._tables[req.request_id]]
        assert all(not kv.block_table(req.request_id) for req in swapped)
    for req in running + swapped:
        kv.free(req)
    assert kv.num_free_blocks == 24 and kv.num_free_swap_blocks == 8
