"""What a scheduler decides for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.request import Request


@dataclass
class SchedulerOutput:
    """Which requests run this step and how many tokens each computes.

    Prefill chunks and decodes share one batch; ``num_computed_before[i]`` is
    the position of request ``i``'s first new token.
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_computed_before: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # block moves the runner performs before the forward pass, in this order:
    # (cache block -> swap slot), (swap slot -> cache block), (source block -> copy-on-write target)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def has_block_moves(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)

    @property
    def is_empty(self) -> bool:
        return not self.requests and not self.has_block_moves
