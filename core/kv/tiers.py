"""Bookkeeping of the KV offload tiers: prefix blocks evicted from the KV pool kept in CPU RAM, then on disk.

Plain Python over block hashes, slots and counts, like the allocator that owns it
(:class:`~pagoda.kv.blocks.PagedKVCacheManager`): this index decides which RAM slot
or disk file a block goes to and comes back from, and records each decision as a
move in :class:`KVTierMoves`. The moves travel in the step's
:class:`~pagoda.step.SchedulerOutput`; the runner's
:class:`~pagoda.kv.offload.KVTierStore` copies the tensors and writes and reads the
files, in the order the fields of :class:`KVTierMoves` are listed.

Both tiers are least-recently-used caches keyed by the prefix cache's chain hash;
the key (parent hash, tokens) kept with each entry confirms a hash hit, as in the
pool. A slot or file that one of this step's moves reads or writes is pinned until
the moves are taken, so no later decision of the same step reuses it before the
runner has done with it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from pagoda.interfaces import has_offload_tiers  # noqa: F401  (where core has always asked it)
from pagoda.step import BlockKey, KVTierMoves


@dataclass
class TierCounters:
    hits: int = 0  # blocks brought back from this tier instead of recomputed
    misses: int = 0  # prompts whose next full block this tier did not have (or had corrupt)
    stored_bytes: int = 0  # bytes written into this tier
    loaded_bytes: int = 0  # bytes read back from it into the KV pool
    corrupt: int = 0  # blocks whose stored copy failed its check when read (disk only)


@dataclass
class KVTierStats:
    ram: TierCounters = field(default_factory=TierCounters)
    disk: TierCounters = field(default_factory=TierCounters)
    num_ram_blocks: int = 0  # blocks each tier holds now
    num_disk_blocks: int = 0

    def tier(self, name: str) -> TierCounters:
        return getattr(self, name)


class KVTierIndex:
    """Which prefix blocks each tier holds, and the moves that put them there and bring them back.

    ``num_ram_slots`` and ``num_disk_blocks`` bound the tiers (0 turns one off); ``disk_entries`` are
    the ``(block hash, key)`` of files already on disk, oldest first (a directory kept across restarts).
    """

    def __init__(self, num_ram_slots: int, num_disk_blocks: int, bytes_per_block: int,
                 disk_entries: Iterable[tuple[int, BlockKey]] = ()) -> None:
        if num_ram_slots < 0 or num_disk_blocks < 0:
            raise ValueError("tier sizes must be >= 0")
        self.num_ram_slots = num_ram_slots
        self.num_disk_blocks = num_disk_blocks
        self.bytes_per_block = bytes_per_block
        self._ram: OrderedDict[int, tuple[BlockKey, int]] = OrderedDict()  # hash -> (key, slot), LRU first
        self._free_slots = list(range(num_ram_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._disk: OrderedDict[int, BlockKey] = OrderedDict()  # hash -> key, LRU first
        self._pinned_slots: set[int] = set()
        self._pinned_files: set[int] = set()
        self._moves = KVTierMoves()
        self.stats = KVTierStats()
        for block_hash, key in disk_entries:
            if len(self._disk) < num_disk_blocks:
                self._disk[block_hash] = key
        self._update_gauges()

    # ---- queries -----------------------------------------------------------

    def lookup(self, block_hash: int, key: BlockKey) -> Optional[str]:
        """The tier holding this block ("ram" before "disk"), or None. Changes nothing."""
        entry = self._ram.get(block_hash)
        if entry is not None and entry[0] == key:
            return "ram"
        if self._disk.get(block_hash) == key:
            return "disk"
        return None

    def holds(self, tier: str) -> list[int]:
        """Block hashes in a tier, least recently used first."""
        return list(self._ram if tier == "ram" else self._disk)

    def ram_slot(self, block_hash: int) -> Optional[int]:
        entry = self._ram.get(block_hash)
        return None if entry is None else entry[1]

    # ---- actions -------------------------------------------------------------

    def offload(self, block_hash: int, key: BlockKey, block_id: int) -> None:
        """A cached block is about to be overwritten in the pool: keep a copy in the first tier with room."""
        if self.lookup(block_hash, key) == "ram":
            self._ram.move_to_end(block_hash)
            return
        if block_hash in self._ram:
            return  # another block under the same hash holds the entry (a 64-bit collision): keep it
        slot = self._take_ram_slot()
        if slot is not None:
            self._ram[block_hash] = (key, slot)
            self._moves.blocks_to_ram.append((block_id, slot))
            self.stats.ram.stored_bytes += self.bytes_per_block
        elif self._disk.get(block_hash) == key:
            self._disk.move_to_end(block_hash)
        elif self._admit_to_disk(block_hash, key):
            self._moves.blocks_to_disk.append((block_id, block_hash, key))
        self._update_gauges()

    def load(self, block_hash: int, key: BlockKey, block_id: int) -> str:
        """Bring a block held by a tier into pool block ``block_id``; returns the tier it came from."""
        tier = self.lookup(block_hash, key)
        if tier == "ram":
            _, slot = self._ram[block_hash]
            self._ram.move_to_end(block_hash)
            self._pinned_slots.add(slot)
            self._moves.ram_to_blocks.append((slot, block_id))
        elif tier == "disk":
            self._disk.move_to_end(block_hash)
            self._pinned_files.add(block_hash)
            self._moves.disk_to_blocks.append((block_hash, block_id))
        else:
            raise KeyError(f"block {block_hash} is in no offload tier")
        counters = self.stats.tier(tier)
        counters.hits += 1
        counters.loaded_bytes += self.bytes_per_block
        return tier

    def pin(self, block_hash: int) -> None:
        """Keep this block's RAM slot and file in place until the step's moves are taken."""
        entry = self._ram.get(block_hash)
        if entry is not None:
            self._pinned_slots.add(entry[1])
        if block_hash in self._disk:
            self._pinned_files.add(block_hash)

    def persist(self, block_hash: int, key: BlockKey, block_id: int) -> None:
        """Write a pool block to disk if it is not there (an engine about to stop keeps it for the next)."""
        if self._disk.get(block_hash) != key and self._admit_to_disk(block_hash, key):
            self._moves.blocks_to_disk.append((block_id, block_hash, key))
        self._update_gauges()

    def persist_ram(self) -> None:
        """Write every RAM entry that is not on disk yet to disk, least recently used first."""
        for block_hash, (key, slot) in list(self._ram.items()):
            if self._disk.get(block_hash) != key and self._admit_to_disk(block_hash, key):
                self._moves.ram_to_disk.append((slot, block_hash, key))
        self._update_gauges()

    def count_miss(self) -> None:
        """A prompt's next full block was in neither the pool nor any tier."""
        if self.num_ram_slots:
            self.stats.ram.misses += 1
        if self.num_disk_blocks:
            self.stats.disk.misses += 1

    def drop_failed_loads(self, block_hashes: Iterable[int]) -> None:
        """Disk blocks whose files failed their check when read (the runner deleted them and recomputed the
        tokens): forget them, and count each as a miss."""
        for block_hash in block_hashes:
            self._disk.pop(block_hash, None)
            self.stats.disk.corrupt += 1
            self.stats.disk.misses += 1
        self._update_gauges()

    def take_moves(self) -> KVTierMoves:
        """The moves decided since the last call; unpins every slot and file."""
        moves, self._moves = self._moves, KVTierMoves()
        self._pinned_slots.clear()
        self._pinned_files.clear()
        return moves

    def reset_ram(self) -> None:
        """Forget the RAM tier (a failed step may have left its slots half written). Files carry their own
        checksum, so the disk tier stays."""
        self._ram.clear()
        self._free_slots = list(range(self.num_ram_slots - 1, -1, -1))
        self._update_gauges()

    # ---- helpers -------------------------------------------------------------

    def _take_ram_slot(self) -> Optional[int]:
        if self._free_slots:
            slot = self._free_slots.pop()
            self._pinned_slots.add(slot)
            return slot
        victim = next((h for h, (_, s) in self._ram.items() if s not in self._pinned_slots), None)
        if victim is None:
            return None  # no RAM tier, or every slot is read or written by this step
        key, slot = self._ram.pop(victim)
        if self._disk.get(victim) == key:
            self._disk.move_to_end(victim)
        elif self._admit_to_disk(victim, key):
            self._moves.ram_to_disk.append((slot, victim, key))
        self._pinned_slots.add(slot)
        return slot

    def _admit_to_disk(self, block_hash: int, key: BlockKey) -> bool:
        """Make room for one file (deleting the least recently used unpinned ones); False if there is none."""
        if not self.num_disk_blocks or block_hash in self._disk:
            return False  # (a file under this hash with another key stays: a load may be reading it)
        while len(self._disk) >= self.num_disk_blocks:
            victim = next((h for h in self._disk if h not in self._pinned_files), None)
            if victim is None:
                return False
            del self._disk[victim]
            self._moves.files_to_delete.append(victim)
        self._disk[block_hash] = key
        self._pinned_files.add(block_hash)
        self.stats.disk.stored_bytes += self.bytes_per_block
        return True

    def _update_gauges(self) -> None:
        self.stats.num_ram_blocks = len(self._ram)
        self.stats.num_disk_blocks = len(self._disk)


class TieredPrefixCache:
    """The allocator's side of the tiers, mixed into :class:`~pagoda.kv.blocks.PagedKVCacheManager`: it
    sets ``self.tiers`` (None while off) and calls :meth:`_load_from_tiers` on its prefix hits; a tier hit
    is a block with id -1 standing for the tier's copy."""

    tiers: Optional[KVTierIndex]

    def init_offload(self, tiers: KVTierIndex) -> None:
        """Keep evicted prefix blocks in these tiers (the runner's KVTierStore holds the matching memory)."""
        self.tiers = tiers if self.enable_prefix_caching else None

    def take_tier_moves(self) -> KVTierMoves:
        """Tier moves decided since the last call, for the scheduler to pass to the runner with the step."""
        return self.tiers.take_moves() if self.tiers is not None else KVTierMoves()

    def spill_to_disk(self) -> KVTierMoves:
        """The moves writing every prefix block held in RAM or in the pool to the disk tier (oldest first),
        so an engine started on the same directory finds them all; empty without a disk tier."""
        if self.tiers is None:
            return KVTierMoves()
        self.tiers.persist_ram()
        for block in list(self._cached.values()):
            self.tiers.persist(block.block_hash, block.key, block.block_id)
        return self.tiers.take_moves()

    def drop_failed_loads(self, block_hashes: Iterable[int]) -> None:
        """Tier blocks the runner found corrupt when loading them (it recomputed their tokens instead)."""
        if self.tiers is not None:
            self.tiers.drop_failed_loads(block_hashes)

    def _load_from_tiers(self, hits: Sequence[Any]) -> list[Any]:
        """Pool hits unchanged; each tier hit becomes a fresh block, registered, with a load scheduled."""
        for hit in hits:
            if hit.block_id < 0:
                self.tiers.pin(hit.block_hash)  # the fresh blocks' evictions must not push a source out
        table = [hit if hit.block_id >= 0 else self._take_fresh() for hit in hits]
        for block, hit in zip(table, hits):
            if hit.block_id < 0:
                self._register(block, hit.key)
                self.tiers.load(hit.block_hash, hit.key, block.block_id)
        return table
