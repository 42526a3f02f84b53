"""The paged allocator's CPU swap pool, mixed into :class:`~pagoda.kv.blocks.PagedKVCacheManager`.

A preempted request's blocks can move to ``num_swap_blocks`` CPU slots and come back later; the
``(block, slot)`` moves travel to the runner in the step's
:class:`~pagoda.step.SchedulerOutput`. Bookkeeping only, over the manager's tables and free queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from pagoda.sequence import Sequence

if TYPE_CHECKING:
    from pagoda.kv.blocks import KVBlock


class SwapPool:
    """Swap slots for :class:`~pagoda.kv.blocks.PagedKVCacheManager`: query/act pairs
    :meth:`can_swap_out` / :meth:`swap_out` and :meth:`can_swap_in` / :meth:`swap_in`. The manager
    owns the state they use (``_tables``, ``_block_ids``, ``_free``, ``_swapped``, ``_free_swap``)."""

    num_swap_blocks: int
    _free_swap: list[int]
    _swapped: dict[str, list[int]]  # request id -> swap slot per table position

    def init_swap_pool(self, num_swap_blocks: int) -> None:
        """Size the CPU swap pool (the runner allocates the matching tensors)."""
        if self._swapped:
            raise RuntimeError("the swap pool cannot be resized while requests are swapped out")
        self.num_swap_blocks = num_swap_blocks
        self._free_swap = list(range(num_swap_blocks - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free_swap_blocks(self) -> int:
        return len(self._free_swap)

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def can_swap_out(self, request: Sequence) -> bool:
        return 0 < len(self._tables.get(request.request_id, ())) <= len(self._free_swap)

    def can_swap_in(self, request: Sequence, num_new_tokens: int) -> bool:
        """Room to bring the request's blocks back and then give it ``num_new_tokens`` more slots."""
        slots = self._swapped.get(request.request_id)
        if slots is None:
            return False
        hits = self._swap_in_hits(request, len(slots))
        # hits still held by someone cost nothing; every other position takes one block from the free queue
        take = len(slots) - sum(1 for b in hits if b is not None and b.ref_cnt > 0)
        grow = max(0, self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(slots))
        return take + grow <= self.num_free_blocks

    def swap_out(self, request: Sequence) -> list[tuple[int, int]]:
        """Release the request's blocks into swap slots; returns ``(block, swap slot)`` pairs to copy."""
        rid = request.request_id
        table = self._tables.pop(rid)
        del self._block_ids[rid]
        slots = [self._free_swap.pop() for _ in table]
        self._swapped[rid] = slots
        self._release(table)
        return [(b.block_id, s) for b, s in zip(table, slots)]

    def swap_in(self, request: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped request back; returns ``(swap slot, block)`` pairs to copy.

        Full blocks still in the prefix cache are shared instead of copied.
        """
        rid = request.request_id
        slots = self._swapped.pop(rid)
        hits = self._swap_in_hits(request, len(slots))
        for block in hits:
            if block is not None:
                self._take_hit(block)
        table = [block if block is not None else self._take_fresh() for block in hits]
        self._tables[rid] = table
        self._block_ids[rid] = [b.block_id for b in table]
        self._free_swap.extend(reversed(slots))
        if self.enable_prefix_caching:
            for i, h in enumerate(self._hashes.get(rid, ())):
                # a full block that came back by copy becomes reusable again
                if table[i].block_hash is None and h not in self._cached:
                    self._register(table[i], self._block_key(request, i, self._hashes[rid]))
        return [(s, b.block_id) for s, b, hit in zip(slots, table, hits) if hit is None]

    def _swap_in_hits(self, request: Sequence, num_slots: int) -> list[Optional[KVBlock]]:
        """Per swapped position: the cached block holding the same full block, else None."""
        hits: list[Optional[KVBlock]] = [None] * num_slots
        if not self.enable_prefix_caching:
            return hits
        hashes = self._hashes.get(request.request_id, ())
        for i, h in enumerate(hashes[:num_slots]):
            block = self._cached.get(h)
            if block is not None and block.key == self._block_key(request, i, hashes):
                hits[i] = block
        return hits
