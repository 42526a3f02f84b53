"""How one forward pass lays out its batch: the flattened tokens, and the description attention backends build
their metadata from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
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


class FlatBatch:
    """The one place a forward pass's batch is laid out: requests' tokens, decodes first, flattened.

    Built from one piece of tokens per request, in the caller's order (a plain
    step's new tokens, a verify pass's last token plus drafts, a draft pass's
    one token each). The attention backends treat requests ``[0, num_decodes)``
    as one-token queries, so one-token pieces go first; :meth:`rows` and
    :meth:`last_row` map hidden-state rows back to the caller's order.
    """

    def __init__(self, pieces: Sequence[Sequence[int]], starts: Sequence[int], block_tables: Sequence[list[int]],
                 block_size: int) -> None:
        n = len(pieces)
        lengths = [len(p) for p in pieces]
        order = sorted(range(n), key=lambda i: lengths[i] != 1)
        num_new = np.array([lengths[i] for i in order], dtype=np.int64)
        starts_sorted = np.array([starts[i] for i in order], dtype=np.int64)
        num_decodes = int((num_new == 1).sum())
        self.input_ids = np.fromiter((t for i in order for t in pieces[i]), dtype=np.int64, count=int(num_new.sum()))

        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        req_of_token = np.repeat(np.arange(n), num_new)
        self.positions = np.arange(num_tokens) - query_start_loc[req_of_token] + starts_sorted[req_of_token]
        seq_lens = starts_sorted + num_new
        max_blocks = max(len(block_tables[i]) for i in order)
        tables = np.zeros((n, max_blocks), dtype=np.int64)
        for row, i in enumerate(order):
            tables[row, :len(block_tables[i])] = block_tables[i]
        slot_mapping = tables[req_of_token, self.positions // block_size] * block_size + \
            self.positions % block_size
        self.attention = AttentionBatch(
            num_reqs=n,
            num_decodes=num_decodes,
            num_tokens=num_tokens,
            query_start_loc=torch.from_numpy(query_start_loc).to(torch.int32),
            seq_lens=torch.from_numpy(seq_lens).to(torch.int32),
            block_tables=torch.from_numpy(tables).to(torch.int32),
            slot_mapping=torch.from_numpy(slot_mapping),
            query_start_loc_list=query_start_loc.tolist(),
            seq_lens_list=seq_lens.tolist(),
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=block_size,
        )
        # request i (caller's order) -> its first row and row count in the hidden states
        self._first = [0] * n
        for row, i in enumerate(order):
            self._first[i] = int(query_start_loc[row])
        self._lengths = lengths

    def rows(self, i: int) -> range:
        """Hidden-state rows of request ``i`` (the caller's order)."""
        return range(self._first[i], self._first[i] + self._lengths[i])

    def last_row(self, i: int) -> int:
        return self._first[i] + self._lengths[i] - 1
