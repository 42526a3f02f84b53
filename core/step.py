"""The step contract: what a scheduler decides for one step, what the runner reports back, and the
batch description the runner hands to the attention backend.

One engine step is ``schedule -> execute -> update -> emit``. The scheduler's
:class:`SchedulerOutput` names the requests to run and how many tokens each
computes; the runner executes it and returns a :class:`RunnerOutput` aligned
with it; the scheduler then commits each request's progress from that result
in ``update``. Nothing before ``update`` moves a request's progress, so a step
whose execution raises leaves every request as it was (``rollback`` then
undoes the step's block work instead). A request ended for an error takes the
same path: ``schedule`` records it in ``SchedulerOutput.failed`` (a request
that can never fit the cache), the runner in ``RunnerOutput.failed`` (a request
whose execution failed alone), and ``update`` (or ``rollback``) ends it.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pagoda.sequence import Sequence

# per sampled token: {token_id: (logprob, rank)} for the sampled token and the top-k alternatives
TokenLogprobs = dict[int, tuple[float, int]]


# (parent block's hash, the block's token ids, extra keys), as in pagoda.kv.blocks
BlockKey = tuple

@dataclass
class KVTierMoves:
    """One step's tier moves, performed by the runner before the forward pass in this field order.

    Deletes and writes come first (they read blocks and slots before anything this step overwrites
    them), loads last (they may read what this step wrote).
    """

    files_to_delete: list[int] = field(default_factory=list)  # block hashes evicted from the disk tier
    # (RAM slot, block hash, key): a RAM entry moving down to disk before its slot is reused
    ram_to_disk: list[tuple[int, int, BlockKey]] = field(default_factory=list)
    blocks_to_ram: list[tuple[int, int]] = field(default_factory=list)  # (cache block, RAM slot)
    # (cache block, block hash, key): straight to disk when no RAM slot is free (or there is no RAM tier)
    blocks_to_disk: list[tuple[int, int, BlockKey]] = field(default_factory=list)
    ram_to_blocks: list[tuple[int, int]] = field(default_factory=list)  # (RAM slot, cache block)
    disk_to_blocks: list[tuple[int, int]] = field(default_factory=list)  # (block hash, cache block)

    def __bool__(self) -> bool:
        return any((self.files_to_delete, self.ram_to_disk, self.blocks_to_ram, self.blocks_to_disk,
                    self.ram_to_blocks, self.disk_to_blocks))


@dataclass
class KVConnectorMoves:
    """One step's blocks in and out of a KV connector's store (pagoda.kv.connector): the runner copies
    ``loads`` into the cache before the forward pass and reads ``saves`` out of it after."""

    # (cache block, verified payload: every layer's slice of the block, raw bytes)
    loads: list[tuple[int, typing.Any]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)  # (cache block, block hash)


@dataclass
class SchedulerOutput:
    """Which requests run this step and how many tokens each computes.

    Prefill chunks and decodes share one batch. For request ``i``:

    - ``num_computed_before[i]``: the position of its first new token (the
      tokens before it have K/V in the cache);
    - ``num_new_tokens[i]``: the positions computed this step, draft slots
      included;
    - ``num_draft_slots[i]``: the last that many of those positions are
      speculative draft slots (0 unless speculative decoding is on and the
      request is decoding): the proposer fills up to that many drafts after
      the request's last token and the target verifies them in the same pass.

    The scheduler's other decisions, committed by ``update`` (or ``rollback``):
    ``preempted`` (a request preempted by recompute loses its progress there),
    and ``failed``, requests taken out of the queues to end with an error.
    """

    requests: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_computed_before: list[int] = field(default_factory=list)
    num_draft_slots: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    # with the window pool on (pagoda.kv.window): per request, its blocks' slots in the sliding-window layers' pool
    window_block_tables: list[list[int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (request, what is wrong and how to fix it): taken out of the queues, ended with the error by update()
    failed: list[tuple[Sequence, str]] = field(default_factory=list)
    # block moves the runner performs before the forward pass, in this order:
    # (cache block -> swap slot), (swap slot -> cache block), (source block -> copy-on-write target)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # the same copies in the window pool: (source slot -> copy's slot)
    window_blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # offload tiers (RAM, disk) of the prefix cache: performed after the swap-outs, before the swap-ins
    kv_tier_moves: KVTierMoves = field(default_factory=KVTierMoves)
    # a KV connector's loads and saves (performed inside the runner's execute)
    kv_connector: KVConnectorMoves = field(default_factory=KVConnectorMoves)
    # structured outputs: the requests (indices into ``requests``) that sample under a grammar this step, and
    # their rows of allowed tokens, int32 [len(grammar_rows), ceil(vocab / 32)] (see
    # pagoda.sampling.structured.bitmask); filled by the engine after schedule(), applied by the runner
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bitmask: Optional[torch.Tensor] = None

    def add(self, request: Sequence, num_new_tokens: int, num_computed_before: int, block_table: list[int],
            num_draft_slots: int = 0, window_block_table: Optional[list[int]] = None) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)
        self.num_computed_before.append(num_computed_before)
        self.num_draft_slots.append(num_draft_slots)
        self.block_tables.append(block_table)
        if window_block_table is not None:
            self.window_block_tables.append(window_block_table)

    def select(self, indices: typing.Sequence[int]) -> "SchedulerOutput":
        """The same step restricted to requests ``indices``, without block moves (for re-running part of it)."""
        sub = SchedulerOutput()
        for i in indices:
            sub.add(self.requests[i], self.num_new_tokens[i], self.num_computed_before[i], self.block_tables[i],
                    self.num_draft_slots[i], self.window_block_tables[i] if self.window_block_tables else None)
        if self.grammar_rows:
            row_of = {i: row for row, i in enumerate(self.grammar_rows)}
            picked = [(j, row_of[i]) for j, i in enumerate(indices) if i in row_of]
            if picked:
                sub.grammar_rows = [j for j, _ in picked]
                sub.grammar_bitmask = self.grammar_bitmask[[row for _, row in picked]]
        return sub

    def num_real_tokens(self, i: int) -> int:
        """Sequence ``i``'s known tokens computed this step (its new tokens without the draft slots)."""
        return self.num_new_tokens[i] - self.num_draft_slots[i]

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def has_block_moves(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy or self.kv_tier_moves
                    or self.window_blocks_to_copy)

    @property
    def is_empty(self) -> bool:
        return not self.requests and not self.has_block_moves


@dataclass
class RunnerOutput:
    """The runner's result, aligned with ``SchedulerOutput.requests``.

    ``sampled_token_ids[i]`` is the list of tokens request ``i`` appends: empty
    when it sampled nothing (a prefill chunk short of the prompt's end), one
    token for an ordinary step, or its accepted drafts followed by one
    corrected or bonus token when it verified ``num_draft_tokens[i]`` drafts.
    ``logprobs[i]`` belongs to the last sampled token (requests asking for
    logprobs never speculate); ``prompt_logprobs[i]`` covers the prompt
    positions computed this step. ``failed[i]`` says why request ``i``'s
    execution failed (the engine ran it alone and it failed again): ``update``
    ends it with that error. ``execute_seconds`` is the wall-clock time the
    step's execution took, set by the engine (the simulator sets its cost
    model's time); None where nothing measured it.
    """

    sampled_token_ids: list[list[int]]
    logprobs: list[Optional[TokenLogprobs]]
    prompt_logprobs: list[Optional[list[TokenLogprobs]]]
    num_draft_tokens: list[int]
    failed: dict[int, str] = field(default_factory=dict)
    execute_seconds: Optional[float] = None
    # (block hash, bytes) of the blocks in ``SchedulerOutput.kv_connector.saves``, read after the forward pass
    kv_saved: list[tuple[int, bytes]] = field(default_factory=list)

    @classmethod
    def empty(cls, num_requests: int) -> "RunnerOutput":
        return cls([[] for _ in range(num_requests)], [None] * num_requests, [None] * num_requests,
                   [0] * num_requests)

    @classmethod
    def merge(cls, num_requests: int, parts: typing.Sequence[tuple[typing.Sequence[int], "RunnerOutput"]]
              ) -> "RunnerOutput":
        """One output from outputs of sub-steps (``SchedulerOutput.select``); requests in none stay empty."""
        out = cls.empty(num_requests)
        for indices, part in parts:
            for j, i in enumerate(indices):
                out.sampled_token_ids[i] = part.sampled_token_ids[j]
                out.logprobs[i] = part.logprobs[j]
                out.prompt_logprobs[i] = part.prompt_logprobs[j]
                out.num_draft_tokens[i] = part.num_draft_tokens[j]
        return out


@dataclass
class AttentionBatch:
    """One step's requests, decodes first, tokens flattened without padding.

    Tensors live on the CPU; a backend moves what it needs to its device once
    per step in ``build_metadata``.
    """

    num_reqs: int
    num_decodes: int  # requests [0, num_decodes) have exactly one query token
    num_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, KV length after this step
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 marks a padding token to skip
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # per request, how many of its tokens are its prompt's (positions below are prompt tokens); None: not known.
    # A backend may attend a prompt's tokens by one path whether or not its first ones came from the cache.
    prompt_lens_list: Optional[list[int]] = None

    def slots_to_write(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The cache slots this step writes (int64) and, only when some tokens are padding (slot -1),
        the indices of the tokens that are written. Backends call it once per step."""
        slot_mapping = self.slot_mapping.to(torch.int64)
        valid = slot_mapping >= 0
        if bool(valid.all()):
            return slot_mapping, None
        tokens = valid.nonzero().flatten()
        return slot_mapping[tokens], tokens


@dataclass
class PoolMetadata:
    """A step's attention metadata when the layers with a sliding window keep their K/V in a pool of their own
    (pagoda.kv.window): the backend's metadata built twice, over the main block tables (``full``) and over the
    window slots (``window``). The attention layer hands its backend the one of its pool, so a backend never
    sees this object."""

    full: Any
    window: Any


@dataclass
class LoRABatch:
    """Which LoRA adapter slot each token of a forward pass applies, laid out once per pass for every layer.

    A slot is a row of the stacked adapter weights a :class:`pagoda.interfaces.LoRABackend` gets: ``lora_a
    [max_loras, rank, in]`` and ``lora_b [max_loras, out, rank]``. Tokens of base-model requests have slot -1
    and take no LoRA term.
    """

    token_slots: torch.Tensor  # int64 [num_tokens]: the slot of each token, -1 for the base model
    lora_rows: torch.Tensor  # int64 [num_lora_tokens]: the tokens that have a slot, ascending
    lora_row_slots: torch.Tensor  # int64 [num_lora_tokens]: their slots
    # one (slot, rows) per adapter of the pass: rows are int64 token indices, ascending
    segments: list[tuple[int, torch.Tensor]]

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor) -> "LoRABatch":
        token_slots = token_slots.to(torch.int64)
        lora_rows = torch.nonzero(token_slots >= 0).flatten()
        row_slots = token_slots[lora_rows]
        segments = [(int(s), lora_rows[row_slots == s]) for s in torch.unique(row_slots).tolist()]
        return cls(token_slots, lora_rows, row_slots, segments)

    @property
    def num_tokens(self) -> int:
        return int(self.token_slots.shape[0])
