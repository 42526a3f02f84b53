"""The window pool's books: which blocks of the main pool hold a *window slot*, the place of their K/V in the
tensors of the layers with a sliding window.

A layer with a window of ``w`` tokens reads, for a query at position ``p``, only the keys at positions
``> p - w``. So a block needs a window slot from the step that first writes into it until the window of every
request holding it has moved past its last position; a block of the prefix cache may keep its slot after that
(a later hit reads it back) until a running request needs the slot (see :meth:`WindowSlots._move_window` for
which go first; then least recently released first). Slot 0 is
never handed out: the window block table points the entries before a request's window at it.

Bookkeeping only, like the rest of the allocator (:class:`~pagoda.kv.blocks.PagedKVCacheManager` mixes it in);
the runner builds the window layers' block tables from :meth:`WindowSlots.window_block_table`.
"""

from __future__ import annotations

import typing
from collections import OrderedDict
from typing import Any, Optional

if typing.TYPE_CHECKING:
    from pagoda.kv.blocks import KVBlock
    from pagoda.sequence import Sequence

# the slot every entry out of a request's window points at (never written)
NULL_SLOT = 0


class WindowSlots:
    """The window-slot side of the paged allocator (off until :meth:`init_window_pool`)."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    _tables: dict[str, list["KVBlock"]]
    _block_ids: dict[str, list[int]]
    window: Optional[int] = None
    num_window_slots: int = 0

    def init_window_pool(self, num_slots: int, window: int) -> None:
        """Turn the window pool on: ``num_slots`` slots (numbered from 1; slot 0 is the null one) for the layers
        whose sliding window is at most ``window`` tokens."""
        if num_slots < 1 or window < 1:
            raise ValueError(f"a window pool needs at least one slot and a window >= 1, got {num_slots}, {window}")
        self.window = window
        self.num_window_slots = num_slots
        self._free_slots = list(range(num_slots, 0, -1))  # pop() hands out the lowest first
        self._slot_of = [NULL_SLOT] * self.num_blocks  # block id -> its window slot
        self._num_live = [0] * self.num_blocks  # block id -> requests whose window covers it
        # prefix-cached blocks keeping a slot no request's window needs, least recently released first
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._window_start: dict[str, int] = {}  # request id -> index of the first block of its table in its window
        self._window_copies: list[tuple[int, int]] = []

    # ---- queries -----------------------------------------------------------

    @property
    def num_free_window_slots(self) -> int:
        """Slots a request may take: free ones and those only the prefix cache keeps."""
        return len(self._free_slots) + len(self._idle) if self.window else 0

    @property
    def window_usage(self) -> float:
        """Fraction of window slots that requests' windows hold (slots only the prefix cache keeps count as free)."""
        return 1.0 - self.num_free_window_slots / self.num_window_slots if self.window else 0.0

    def window_first_block(self, num_computed: int) -> int:
        """The first table index a step starting at position ``num_computed`` reads in a window layer."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def window_block_table(self, request_id: str) -> list[int]:
        """The request's block table for the window layers: each block's window slot, the null slot before its
        window."""
        ids = self._block_ids.get(request_id, ())
        start = min(self._window_start.get(request_id, 0), len(ids))
        slot_of = self._slot_of
        return [NULL_SLOT] * start + [slot_of[b] for b in ids[start:]]

    def take_window_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write moves of window slots decided since the last call: ``(source slot, copy's slot)``."""
        copies, self._window_copies = self._window_copies, []
        return copies

    def num_window_slots_to_take(self, request: "Sequence", num_computed: int, num_fresh: int,
                                 computed_blocks: typing.Sequence["KVBlock"] = ()) -> int:
        """Window slots an allocation taking ``num_fresh`` new blocks (copies included) at position
        ``num_computed`` uses, less those its window moving on gives back (may be negative)."""
        start = self.window_first_block(num_computed)
        # prefix hits in the window that no running request holds there: they leave the idle slots
        revived = sum(1 for b in computed_blocks[start:] if self._num_live[b.block_id] == 0)
        table = self._tables.get(request.request_id, ())
        old = self._window_start.get(request.request_id, 0)
        released = sum(1 for b in table[old:min(start, len(table))] if self._num_live[b.block_id] == 1)
        return num_fresh + revived - released

    def cut_hits_to_window(self, hits: list["KVBlock"]) -> list["KVBlock"]:
        """The longest prefix of ``hits`` whose last ceil((window - 1) / block_size) blocks hold window slots: a
        hit on a prefix whose window K/V are gone would have to recompute them."""
        if not self.window:
            return hits
        need = -(-(self.window - 1) // self.block_size)
        k = len(hits)
        while k > 0:
            missing = [j for j in range(max(0, k - need), k) if self._slot_of[hits[j].block_id] == NULL_SLOT]
            if not missing:
                break
            k = missing[-1]  # a hit ending at or after a slotless block must end before it
        return hits[:k]

    # ---- actions (called by the allocator's own) ---------------------------------------------------

    def _hold_window(self, block: "KVBlock") -> None:
        """One more request's window covers ``block`` (which has a slot)."""
        if self._num_live[block.block_id] == 0:
            self._idle.pop(block.block_id, None)
        self._num_live[block.block_id] += 1

    def _drop_window(self, block: "KVBlock", is_first_to_go: bool = False) -> None:
        """One request's window left ``block``: with none left, its slot goes back (or idles, for a cached block:
        given up before the other idle ones if ``is_first_to_go``)."""
        bid = block.block_id
        self._num_live[bid] -= 1
        if self._num_live[bid] == 0 and self._slot_of[bid] != NULL_SLOT:
            if block.block_hash is not None:
                self._idle[bid] = None
                if is_first_to_go:
                    self._idle.move_to_end(bid, last=False)
            else:
                self._free_slots.append(self._slot_of[bid])
                self._slot_of[bid] = NULL_SLOT

    def _give_slot(self, block: "KVBlock") -> None:
        """A block about to be written gets a slot, held by the writing request's window."""
        if self._free_slots:
            slot = self._free_slots.pop()
        else:  # the least recently released cached block gives its slot up
            victim, _ = self._idle.popitem(last=False)
            slot, self._slot_of[victim] = self._slot_of[victim], NULL_SLOT
        self._slot_of[block.block_id] = slot
        self._num_live[block.block_id] = 1

    def _forget_slot(self, block: "KVBlock") -> None:
        """A free block is handed out anew: the slot its old contents kept goes back."""
        bid = block.block_id
        if self._slot_of[bid] != NULL_SLOT:
            self._idle.pop(bid, None)
            self._free_slots.append(self._slot_of[bid])
            self._slot_of[bid] = NULL_SLOT

    def _move_window(self, request_id: str, table: list["KVBlock"], start: int, num_prompt_blocks: int) -> None:
        """The request's window now begins at table index ``start``: the blocks it left are dropped.

        Which idle slots the prefix cache gives up first: a later hit ending at block j needs the slots of the
        ceil((window - 1) / block_size) blocks up to j, and its likely ends are a prompt's end (a repeated
        prompt), the end of an output (a next turn: the request still holds those when it finishes) and blocks
        hit before (a shared prefix). So the blocks left deeper than that behind the window, and the output's,
        go first, unless a hit has found them already."""
        old = self._window_start.get(request_id, 0)
        reach = min(start, num_prompt_blocks) - -(-(self.window - 1) // self.block_size)
        for i in range(old, min(start, len(table))):
            block = table[i]
            self._drop_window(block, is_first_to_go=(i < reach or i >= num_prompt_blocks) and not block.num_hits)
        self._window_start[request_id] = max(old, start)

    def _drop_request_window(self, request_id: str, table: list["KVBlock"], keep: int = 0) -> None:
        """The request gives up its window over its table from index ``keep`` on (freed, or trimmed to it)."""
        start = self._window_start.get(request_id, 0)
        for block in table[max(start, keep):]:
            self._drop_window(block)
        if keep == 0:
            self._window_start.pop(request_id, None)

    def _release_idle_slots(self) -> None:
        """The prefix cache was emptied: the slots only it kept go back."""
        for bid in self._idle:
            self._free_slots.append(self._slot_of[bid])
            self._slot_of[bid] = NULL_SLOT
        self._idle.clear()

    def window_accounting(self) -> dict[str, Any]:
        """The pool's books, for checks: slots handed out, held by windows, idle, free."""
        held = [s for s in self._slot_of if s != NULL_SLOT]
        return dict(num_slots=self.num_window_slots, num_free=len(self._free_slots), num_idle=len(self._idle),
                    num_held=len(held), num_distinct=len(set(held)),
                    num_live_blocks=sum(1 for n in self._num_live if n))
