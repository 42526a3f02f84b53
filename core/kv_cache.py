"""The ``paged`` KV allocator: a pool of fixed-size blocks with ref counts and a prefix cache.

Bookkeeping only: block ids, ref counts, hashes. The tensors that hold K/V
live in the model runner, indexed by the ids handed out here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pagoda.config import CacheConfig
from pagoda.markers import hookimpl
from pagoda.request import Request


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # set when the block is full and registered in the prefix cache
    block_hash: Optional[int] = None
    token_ids: Optional[tuple[int, ...]] = None


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


def hash_block(parent_hash: Optional[int], token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    """Chain hash of a full block: the parent's hash, the block's tokens, extra keys."""
    return hash((parent_hash, tuple(token_ids), extra_keys))


@dataclass
class PagedKVCacheManager:
    """Hands out block ids to requests and reclaims them.

    Query/act pairs: :meth:`get_computed_blocks` then :meth:`allocate_slots`
    (which returns False instead of allocating partially); :meth:`free`.
    Freed blocks that hold a full, hashed block stay in the prefix cache and
    are evicted least-recently-freed first when the pool needs them.
    """

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    blocks: list[KVBlock] = field(init=False)
    # ref_cnt == 0 blocks, oldest first; cached ones are evicted from here on reuse
    _free: "OrderedDict[int, KVBlock]" = field(init=False)
    _cached: dict[int, KVBlock] = field(init=False, default_factory=dict)
    _tables: dict[str, list[KVBlock]] = field(init=False, default_factory=dict)
    # per request: hashes of its full blocks, so appends extend the chain
    _hashes: dict[str, list[int]] = field(init=False, default_factory=dict)
    stats: PrefixCacheStats = field(init=False, default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        self._free = OrderedDict((b.block_id, b) for b in self.blocks)

    # ---- queries -----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def num_blocks_held(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute, so a fully cached prompt
        still produces logits.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return [], 0
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[KVBlock] = []
        parent: Optional[int] = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = hash_block(parent, chunk)
            block = self._cached.get(h)
            if block is None or block.token_ids != chunk:
                break
            hits.append(block)
            parent = h
        return hits, len(hits) * self.block_size

    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()) -> bool:
        return self._num_blocks_to_take(request, num_new_tokens, computed_blocks) <= self.num_free_blocks

    # ---- actions -------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()) -> bool:
        """Give the request room for ``num_new_tokens`` more tokens; False if the pool is short.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, first allocation
        only) are shared, not copied; the caller then advances the request's
        ``num_computed_tokens`` past them.
        """
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            return False
        table = self._tables.setdefault(request.request_id, [])
        if request.num_computed_tokens == 0 and self.enable_prefix_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += len(computed_blocks) * self.block_size
        for block in computed_blocks:
            self._take_hit(block)
        table.extend(computed_blocks)
        if computed_blocks:
            self._hashes[request.request_id] = [b.block_hash for b in computed_blocks]
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        while len(table) < self.blocks_needed(total):
            table.append(self._take_fresh())
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, table, total)
        return True

    def free(self, request: Request | str) -> None:
        """Return every block the request holds; full hashed blocks stay cached."""
        request_id = request if isinstance(request, str) else request.request_id
        table = self._tables.pop(request_id, [])
        self._hashes.pop(request_id, None)
        # free the tail first so, under LRU, a prompt's last blocks go before its first
        for block in reversed(table):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = None
            block.token_ids = None
        self._cached.clear()

    # ---- helpers -------------------------------------------------------------

    def _num_blocks_to_take(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock]) -> int:
        held = len(self._tables.get(request.request_id, ()))
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - held - len(computed_blocks)
        # cached blocks reused from the free queue leave it too
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        return max(needed, 0) + revived

    def _take_hit(self, block: KVBlock) -> None:
        if block.ref_cnt == 0:
            del self._free[block.block_id]
        block.ref_cnt += 1

    def _take_fresh(self) -> KVBlock:
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            # its old contents are about to be overwritten: drop it from the prefix cache
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
        block.ref_cnt = 1
        return block

    def _cache_full_blocks(self, request: Request, table: list[KVBlock], num_tokens: int) -> None:
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        tokens = request.all_token_ids
        while len(hashes) < num_full:
            i = len(hashes)
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = hash_block(hashes[-1] if hashes else None, chunk)
            hashes.append(h)
            block = table[i]
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                block.token_ids = chunk
                self._cached[h] = block


@hookimpl
def pagoda_kv_allocators():
    def make_paged(cache_config: CacheConfig, num_blocks: int) -> PagedKVCacheManager:
        return PagedKVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)

    return {"paged": make_paged}
