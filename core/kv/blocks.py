"""The ``paged`` KV allocator: a pool of fixed-size blocks with ref counts, a prefix cache,
copy-on-write and a CPU swap pool.

Bookkeeping only: block ids, ref counts, hashes. The tensors that hold K/V
live in the model runner, indexed by the ids handed out here; the block moves
this manager decides (swap out, swap in, copy) travel to the runner in the
:class:`~pagoda.step.SchedulerOutput`.
"""

from __future__ import annotations

import heapq
import itertools
import typing
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from pagoda import hookimpl
from pagoda.config import CacheConfig
from pagoda.kv.swap import SwapPool
from pagoda.kv.tiers import KVTierIndex, TieredPrefixCache
from pagoda.kv.window import NULL_SLOT, WindowSlots
from pagoda.sequence import Sequence

# what a cached block's hash stands for: (parent block's hash, the block's token ids, extra keys)
BlockKey = tuple[Optional[int], tuple[int, ...], tuple]


@dataclass(eq=False)
class KVBlock:
    """One block of the pool, as the allocator keeps its books (read-only to policies)."""

    block_id: int
    ref_cnt: int = 0
    # set while the block is full and registered in the prefix cache; ``key`` confirms a hash hit
    block_hash: Optional[int] = None
    key: Optional[BlockKey] = None
    # prefix-cache hits on the block's current contents (reset when it is overwritten with others)
    num_hits: int = 0


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


def hash_block(parent_hash: Optional[int], token_ids: typing.Sequence[int], extra_keys: tuple = ()) -> int:
    """Chain hash of a full block: the parent's hash (-1 for the first block: None's hash differs between
    processes before Python 3.12, so would the disk tier's file names), the block's tokens, extra keys."""
    return hash((-1 if parent_hash is None else parent_hash, tuple(token_ids), extra_keys))


class PagedKVCacheManager(SwapPool, TieredPrefixCache, WindowSlots):
    """Hands out block ids to requests and reclaims them.

    Query/act pairs: :meth:`get_computed_blocks` then :meth:`can_allocate` /
    :meth:`allocate_slots`; :meth:`can_swap_out` / :meth:`swap_out`;
    :meth:`can_swap_in` / :meth:`swap_in`; :meth:`fork`; :meth:`free`.

    - Prefix cache: a full block is registered under its chain hash as soon as
      its slots are handed out; freed registered blocks stay reusable until the
      pool needs them (blocks holding nothing reusable are handed out before any
      cached one). Which cached block is overwritten first is
      :meth:`eviction_key`'s choice: by default the least recently freed.
    - Copy-on-write: a request about to write into a block that others also
      hold gets a private copy first; the (source, copy) pairs wait in
      :meth:`take_block_copies` for the scheduler to pass to the runner.
    - Swap: a request's blocks can move to a CPU pool of ``num_swap_blocks``
      slots (:meth:`init_swap_pool`) and back (:class:`~pagoda.kv.swap.SwapPool`).
    - Offload tiers (:meth:`init_offload`): a cached block the pool is about to
      overwrite is kept in CPU RAM, then on disk; a later prefix hit on it takes
      a fresh block and loads it back. The moves wait in :meth:`take_tier_moves`.
    - Window pool (:meth:`init_window_pool`, :class:`~pagoda.kv.window.WindowSlots`): a block holds a slot
      in the sliding-window layers' smaller pool only while some request's window covers it (or, cached, until
      a running request needs the slot); prefix hits are cut to what the window layers still hold.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_swap_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # ref_cnt == 0 blocks in eviction order: handed out from the front
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}
        self._tables: dict[str, list[KVBlock]] = {}
        # per request: the same table as block ids, kept in step with ``_tables`` (block_table copies it)
        self._block_ids: dict[str, list[int]] = {}
        # per request: chain hashes of its full blocks, so appends extend the chain
        self._hashes: dict[str, list[int]] = {}
        # per request: token slots handed out (computed + scheduled), for occupancy
        self._num_slots: dict[str, int] = {}
        # forked sequences not yet allocated: the tokens they share, the position their first slot follows
        self._forked_at: dict[str, int] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.num_swap_blocks = 0
        self._free_swap: list[int] = []
        self._swapped: dict[str, list[int]] = {}  # request id -> swap slot per table position
        self.stats = PrefixCacheStats()
        self.tiers: Optional[KVTierIndex] = None  # the offload tiers' books, when on
        # a subclass's eviction_key orders the free cached blocks in a heap of (key, tie, block id); the
        # default keeps ``_free``'s order (least recently freed first) and needs none
        self._is_keyed_eviction = type(self).eviction_key is not PagedKVCacheManager.eviction_key
        self._eviction_heap: list[tuple[Any, int, int]] = []
        self._eviction_tie: dict[int, int] = {}  # block id -> its live heap entry's tie
        self._eviction_count = itertools.count()
        self.init_swap_pool(num_swap_blocks)

    # ---- policy: the public method an eviction policy overrides ------------------------------------

    def eviction_key(self, block: KVBlock) -> Any:
        """Called when a block holding a cached prefix is freed by its last holder: among such free
        blocks, the one with the smallest key is overwritten first when the pool needs a block (ties: the
        least recently freed). The key is fixed until the block is taken again (a prefix hit or an
        eviction); ``block.num_hits`` counts the prefix hits on its contents. Blocks holding nothing
        reusable are always handed out before any cached one. The default, None, is least recently freed
        first (LRU)."""
        return None

    # ---- queries -----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        ids = self._block_ids.get(request_id)
        return [] if ids is None else ids.copy()

    def num_blocks_held(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def num_exclusive_blocks(self, request_id: str) -> int:
        """Blocks that freeing the request would return to the pool (those no one else holds)."""
        return sum(1 for b in self._tables.get(request_id, ()) if b.ref_cnt == 1)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def token_occupancy(self) -> tuple[int, int]:
        """``(tokens held, token slots allocated)`` over blocks held by requests.

        A shared block counts once, as full as its fullest holder. KV waste is
        ``1 - held / allocated``: the unfilled tail of each request's last block.
        """
        filled: dict[int, int] = {}
        bs = self.block_size
        for request_id, table in self._tables.items():
            num_slots = self._num_slots.get(request_id, 0)
            for i, block in enumerate(table):
                n = min(bs, max(0, num_slots - i * bs))
                if n > filled.get(block.block_id, -1):
                    filled[block.block_id] = n
        return sum(filled.values()), len(filled) * bs

    def get_computed_blocks(self, request: Sequence) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute, so a fully cached prompt
        still produces logits. A request asking for prompt logprobs computes its
        whole prompt: cached positions would have no logits.
        """
        if (not self.enable_prefix_caching or request.num_computed_tokens > 0
                or request.sampling_params.prompt_logprobs is not None):
            return [], 0
        tokens = request.all_token_ids
        bs = self.block_size
        hits: list[KVBlock] = []
        parent: Optional[int] = None
        extra = _extra_keys(request)
        for i in range((len(tokens) - 1) // bs):
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]), extra)
            parent = hash_block(*key)
            block = self._cached.get(parent)
            if block is None or block.key != key:
                if self.tiers is None or self.tiers.lookup(parent, key) is None:
                    break
                block = KVBlock(-1, block_hash=parent, key=key)  # in a tier: loaded into a fresh block
            hits.append(block)
        if self.window is not None:
            hits = self.cut_hits_to_window(hits)
        return hits, len(hits) * bs

    def num_blocks_to_take(self, request: Sequence, num_new_tokens: int,
                           computed_blocks: typing.Sequence[KVBlock] = ()) -> int:
        """Blocks :meth:`allocate_slots` would take from the free queue (fresh, revived or copies)."""
        table = self._tables.get(request.request_id, ())
        num_computed = self._position(request) + len(computed_blocks) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(table) - len(computed_blocks)
        # cached blocks reused from the free queue leave it too
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        return max(needed, 0) + revived + int(self._needs_copy(table, num_computed))

    def can_allocate(self, request: Sequence, num_new_tokens: int,
                     computed_blocks: typing.Sequence[KVBlock] = ()) -> bool:
        """Whether the free blocks (and, with the window pool, the free window slots) hold the allocation."""
        if self.num_blocks_to_take(request, num_new_tokens, computed_blocks) > self.num_free_blocks:
            return False
        return self.window is None or self._window_fits(request, num_new_tokens, computed_blocks)

    def _window_fits(self, request: Sequence, num_new_tokens: int, computed_blocks: typing.Sequence[KVBlock]) -> bool:
        table = self._tables.get(request.request_id, ())
        num_computed = self._position(request) + len(computed_blocks) * self.block_size
        num_fresh = max(self.blocks_needed(num_computed + num_new_tokens) - len(table) - len(computed_blocks), 0)
        num_fresh += int(self._needs_copy(table, num_computed))
        return self.num_window_slots_to_take(request, num_computed, num_fresh, computed_blocks) <= \
            self.num_free_window_slots

    # ---- actions -------------------------------------------------------------

    def allocate_slots(self, request: Sequence, num_new_tokens: int,
                       computed_blocks: typing.Sequence[KVBlock] = ()) -> bool:
        """Give the request room for ``num_new_tokens`` more tokens; False (and nothing changed) if short.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, first allocation
        only) are shared, not copied; the caller then advances the request's
        ``num_computed_tokens`` past them. A shared block about to be written is
        copied first (copy-on-write).
        """
        rid = request.request_id
        table = self._tables.get(rid)
        num_computed = request.num_computed_tokens
        if table is None or num_computed == 0 or computed_blocks:
            return self._allocate_first(request, num_new_tokens, computed_blocks)
        # a request that holds blocks grows (a decode, its next prefill chunk): no prefix lookup, no stats
        total = num_computed + num_new_tokens
        num_fresh = self.blocks_needed(total) - len(table)
        needs_copy = self._needs_copy(table, num_computed)
        if max(num_fresh, 0) + needs_copy > len(self._free):
            return False
        if self.window is not None:
            if not self._window_fits(request, num_new_tokens, ()):
                return False
            self._move_window(rid, table, self.window_first_block(num_computed),
                              request.num_prompt_tokens // self.block_size)
        if num_fresh > 0 or needs_copy:
            ids = self._block_ids[rid]
            if needs_copy:
                self._copy_on_write(table, ids, num_computed)
            for _ in range(num_fresh):
                block = self._take_fresh()
                table.append(block)
                ids.append(block.block_id)
        if total > self._num_slots[rid]:  # (set wherever a table is)
            self._num_slots[rid] = total
        if self.enable_prefix_caching:
            # (min(total, num_tokens) // bs: the full blocks whose tokens are known)
            bs = self.block_size
            hashes = self._hashes.get(rid)
            if hashes is None or (len(hashes) < total // bs and len(hashes) < len(request.all_token_ids) // bs):
                self._cache_full_blocks(request, table, total)
        return True

    def _allocate_first(self, request: Sequence, num_new_tokens: int,
                        computed_blocks: typing.Sequence[KVBlock]) -> bool:
        """:meth:`allocate_slots` for a request not yet computed (prefix hits, stats) or holding no table."""
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            return False
        rid = request.request_id
        table = self._tables.setdefault(rid, [])
        ids = self._block_ids.setdefault(rid, [])
        position = self._position(request)
        if position == 0 and self.enable_prefix_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += len(computed_blocks) * self.block_size
            if self.tiers is not None and len(computed_blocks) < (request.num_tokens - 1) // self.block_size:
                self.tiers.count_miss()
        for block in computed_blocks:
            if block.block_id >= 0:
                self._take_hit(block)
        if computed_blocks:
            loaded = self._load_from_tiers(computed_blocks)
            table.extend(loaded)
            ids.extend(b.block_id for b in loaded)
            self._hashes[rid] = [b.block_hash for b in computed_blocks]
        num_computed = position + len(computed_blocks) * self.block_size
        self._forked_at.pop(rid, None)
        if self.window is not None:
            first = self.window_first_block(num_computed)
            if computed_blocks:  # a new request's table is its hits: its window holds those it covers
                for block in table[first:]:
                    self._hold_window(block)
                self._window_start[rid] = first
            else:
                self._move_window(rid, table, first, request.num_prompt_tokens // self.block_size)
        if self._needs_copy(table, num_computed):
            self._copy_on_write(table, ids, num_computed)
        total = num_computed + num_new_tokens
        while len(table) < self.blocks_needed(total):
            block = self._take_fresh()
            table.append(block)
            ids.append(block.block_id)
        self._num_slots[rid] = max(self._num_slots.get(rid, 0), total)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, table, total)
        return True

    def fork(self, source: Sequence, child: Sequence, num_tokens: int) -> None:
        """Let ``child`` share the blocks holding ``source``'s first ``num_tokens`` tokens.

        The tokens must be identical in both (``n > 1`` sequences of one
        prompt). Nothing is copied now: a partially filled last block is copied
        when either request first writes into it. The child's next
        :meth:`allocate_slots` makes room after those ``num_tokens`` tokens
        (its ``num_computed_tokens`` moves only when the scheduler commits the step).
        """
        shared = self._tables[source.request_id][:self.blocks_needed(num_tokens)]
        for block in shared:
            block.ref_cnt += 1
        self._tables[child.request_id] = list(shared)
        self._block_ids[child.request_id] = [b.block_id for b in shared]
        self._hashes[child.request_id] = list(self._hashes.get(source.request_id, ())[:num_tokens // self.block_size])
        self._num_slots[child.request_id] = num_tokens
        self._forked_at[child.request_id] = num_tokens
        if self.window is not None:
            first = self.window_first_block(num_tokens)
            for block in shared[first:]:
                self._hold_window(block)
            self._window_start[child.request_id] = first

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write moves decided since the last call: ``(source block, private copy)``."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def trim_slots(self, request: Sequence, num_tokens: int) -> None:
        """Keep room for the request's first ``num_tokens`` tokens only; later blocks go back to the pool.

        Speculative decoding hands out slots for draft tokens and calls this
        once the rejected ones are known. Blocks past ``num_tokens`` hold no
        known token, so none of them is in the prefix cache.
        """
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        keep = self.blocks_needed(num_tokens)
        if len(table) > keep:
            if self.window is not None:
                self._drop_request_window(rid, table, keep)
            self._release(table[keep:])
            del table[keep:]
            del self._block_ids[rid][keep:]
        self._num_slots[rid] = min(self._num_slots.get(rid, 0), num_tokens)

    def free(self, request: Sequence | str) -> None:
        """Return every block and swap slot the request holds; full hashed blocks stay cached."""
        request_id = request if isinstance(request, str) else request.request_id
        table = self._tables.pop(request_id, [])
        if self.window is not None:
            self._drop_request_window(request_id, table)
        self._release(table)
        self._block_ids.pop(request_id, None)
        self._free_swap.extend(reversed(self._swapped.pop(request_id, [])))
        self._hashes.pop(request_id, None)
        self._num_slots.pop(request_id, None)
        self._forked_at.pop(request_id, None)

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = None
            block.key = None
        self._cached.clear()
        if self.window is not None:
            self._release_idle_slots()
        if self.tiers is not None:
            self.tiers.reset_ram()

    # ---- helpers -------------------------------------------------------------

    def _position(self, request: Sequence) -> int:
        """Where the request's next slot goes: its computed tokens, or the tokens a fork gave it."""
        return request.num_computed_tokens or self._forked_at.get(request.request_id, 0)

    def _needs_copy(self, table: typing.Sequence[KVBlock], num_computed: int) -> bool:
        # only the block holding the first new token can be both shared and written:
        # earlier blocks are read-only, later ones are the request's own
        i = num_computed // self.block_size
        return num_computed % self.block_size != 0 and i < len(table) and table[i].ref_cnt > 1

    def _copy_on_write(self, table: list[KVBlock], ids: list[int], num_computed: int) -> None:
        # the shared block holding the first new token (see _needs_copy) becomes the request's own copy
        i = num_computed // self.block_size
        source = table[i]
        source.ref_cnt -= 1
        table[i] = self._take_fresh()
        ids[i] = table[i].block_id
        self._pending_copies.append((source.block_id, ids[i]))
        if self.window is not None:
            if self._slot_of[source.block_id] != NULL_SLOT:
                self._window_copies.append((self._slot_of[source.block_id], self._slot_of[ids[i]]))
            self._drop_window(source)

    def _release(self, table: list[KVBlock]) -> None:
        # the tail first so, under LRU, a prompt's last blocks go before its first
        for block in reversed(table):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    # nothing reusable in it: hand it out before any cached block
                    self._free.move_to_end(block.block_id, last=False)
                elif self._is_keyed_eviction:
                    tie = next(self._eviction_count)
                    self._eviction_tie[block.block_id] = tie
                    heapq.heappush(self._eviction_heap, (self.eviction_key(block), tie, block.block_id))

    def _take_hit(self, block: KVBlock) -> None:
        if block.ref_cnt == 0:
            del self._free[block.block_id]
            self._eviction_tie.pop(block.block_id, None)  # its heap entry is stale now
        block.ref_cnt += 1
        block.num_hits += 1

    def _take_fresh(self) -> KVBlock:
        if self._is_keyed_eviction:
            block = self._take_by_key()
        else:
            _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            # its old contents are about to be overwritten: drop it from the prefix cache
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.tiers is not None:
                    self.tiers.offload(block.block_hash, block.key, block.block_id)
            block.block_hash = None
            block.key = None
        block.num_hits = 0
        block.ref_cnt = 1
        if self.window is not None:  # every block taken here is written by the request taking it
            self._forget_slot(block)
            self._give_slot(block)
        return block

    def _take_by_key(self) -> KVBlock:
        """The next free block under :meth:`eviction_key`: an uncached one if any (they lead ``_free``),
        else the cached one with the smallest key."""
        first = next(iter(self._free.values()))
        if first.block_hash is None and first.block_id not in self._eviction_tie:
            return self._free.pop(first.block_id)
        while True:
            _, tie, block_id = heapq.heappop(self._eviction_heap)
            if self._eviction_tie.get(block_id) == tie:  # else taken and freed again since: a stale entry
                del self._eviction_tie[block_id]
                return self._free.pop(block_id)

    def _register(self, block: KVBlock, key: BlockKey) -> None:
        block.block_hash = hash_block(*key)
        block.key = key
        self._cached[block.block_hash] = block

    def _block_key(self, request: Sequence, i: int, hashes: list[int]) -> BlockKey:
        bs = self.block_size
        return (hashes[i - 1] if i else None, tuple(request.all_token_ids[i * bs:(i + 1) * bs]), _extra_keys(request))

    def _cache_full_blocks(self, request: Sequence, table: list[KVBlock], num_tokens: int) -> None:
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            key = self._block_key(request, i, hashes)
            h = hash_block(*key)
            hashes.append(h)
            if table[i].block_hash is None and h not in self._cached:
                self._register(table[i], key)


def _extra_keys(request: Sequence) -> tuple:
    """What a block's K/V depend on besides its tokens: the LoRA adapter (no hit across adapters)."""
    return () if request.lora_request is None else request.lora_request.cache_key


@hookimpl
def pagoda_kv_allocators():
    def make_paged(cache_config: CacheConfig, num_blocks: int) -> PagedKVCacheManager:
        return PagedKVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)

    return {"paged": make_paged}
