"""The per-step description of a flattened batch that attention backends build their metadata from."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
