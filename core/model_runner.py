"""Turns a schedule into tensors, runs the model, samples. Keeps no books of its own."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from pagoda import hugepages
from pagoda.attention_batch import AttentionBatch
from pagoda.config import EngineConfig
from pagoda.request import Request
from pagoda.sampler import TokenLogprobs, prompt_logprobs_for
from pagoda.scheduler_output import SchedulerOutput


@dataclass
class RunnerOutput:
    """Aligned with ``SchedulerOutput.requests``: None where a request did not sample this step.

    With speculative decoding, a request that had draft slots gets a list: its accepted drafts
    followed by one corrected or bonus token.
    """

    sampled_token_ids: list[Optional[int | list[int]]]
    logprobs: list[Optional[TokenLogprobs]]
    prompt_logprobs: list[Optional[list[TokenLogprobs]]]


class ModelRunner:
    """Owns the model, the KV tensors and the sampler; executes one step at a time."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, backend: Any, sampler: Any,
                 num_blocks: int) -> None:
        self.config = config
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.block_size = config.cache.block_size
        self.device = torch.device(config.device)
        self.num_blocks = num_blocks
        shape = backend.kv_cache_shape(num_blocks)
        kv_dtype = getattr(backend, "kv_cache_dtype", None) or config.model.dtype
        # zeroed (masked-out slots are multiplied by 0 and must not hold NaN), after asking for huge
        # pages so the first touch already gets them
        self.kv_caches = [torch.empty(shape, dtype=kv_dtype, device=self.device)
                          for _ in range(config.model.num_layers)]
        hugepages.advise_tensors(itertools.chain(self.kv_caches, model.parameters(), model.buffers()))
        for cache in self.kv_caches:
            cache.zero_()
        # the block axis of the backend's layout, found by asking for a 1-block and a 2-block shape
        one, two = backend.kv_cache_shape(1), backend.kv_cache_shape(2)
        self.block_dim = next(i for i, (a, b) in enumerate(zip(one, two)) if a != b)
        self.swap_caches: Optional[list[torch.Tensor]] = None
        # a speculative draft model's own KV tensors, indexed by the same block ids (moved with the target's)
        self.draft_kv_caches: list[torch.Tensor] = []
        # set when speculative decoding is on: runs the steps that verify draft tokens
        self.speculator: Any = None

    def allocate_swap_space(self, num_swap_blocks: int) -> None:
        """CPU memory for swapped-out blocks, laid out like the cache itself."""
        self.num_swap_blocks = num_swap_blocks
        self.swap_caches = [self._swap_like(c) for c in self.kv_caches + self.draft_kv_caches]

    def _swap_like(self, cache: torch.Tensor) -> torch.Tensor:
        shape = list(cache.shape)
        shape[self.block_dim] = self.num_swap_blocks
        return torch.zeros(shape, dtype=cache.dtype, device="cpu")

    def add_draft_kv_caches(self, caches: list[torch.Tensor]) -> None:
        """Register a speculative draft's own KV tensors (same block ids): swaps and copies move them too."""
        self.draft_kv_caches.extend(caches)
        if self.swap_caches is not None:
            self.swap_caches.extend(self._swap_like(c) for c in caches)

    def move_blocks(self, sched: SchedulerOutput) -> None:
        """Swap out, swap in, then copy-on-write, for every layer."""
        moves = ((sched.blocks_to_swap_out, "out"), (sched.blocks_to_swap_in, "in"), (sched.blocks_to_copy, "copy"))
        for pairs, kind in moves:
            if not pairs:
                continue
            src = torch.tensor([a for a, _ in pairs], dtype=torch.int64)
            dst = torch.tensor([b for _, b in pairs], dtype=torch.int64)
            for layer, cache in enumerate(self.kv_caches + self.draft_kv_caches):
                if kind == "out":
                    source, target = cache, self.swap_caches[layer]
                elif kind == "in":
                    source, target = self.swap_caches[layer], cache
                else:
                    source, target = cache, cache
                source, target = _raw_bytes(source), _raw_bytes(target)  # index_copy_ has no fp8 kernel on a CPU
                target.index_copy_(self.block_dim, dst.to(target.device),
                                   source.index_select(self.block_dim, src.to(source.device)).to(target.device))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if sched.has_block_moves:
            self.move_blocks(sched)
        n = len(sched.requests)
        if n == 0:
            return RunnerOutput([], [], [])
        if self.speculator is not None:
            return self.speculator.execute(sched)
        # decodes first: the backends treat requests [0, num_decodes) as one-token queries
        order = sorted(range(n), key=lambda i: sched.num_new_tokens[i] != 1)
        reqs = [sched.requests[i] for i in order]
        num_new = np.array([sched.num_new_tokens[i] for i in order], dtype=np.int64)
        starts = np.array([sched.num_computed_before[i] for i in order], dtype=np.int64)
        num_decodes = int((num_new == 1).sum())

        input_ids = np.concatenate([r.all_token_ids[s:s + k] for r, s, k in zip(reqs, starts.tolist(),
                                                                                  num_new.tolist())])
        hidden, query_start_loc, seq_lens = self.forward(input_ids, starts, num_new, num_decodes,
                                                         [sched.block_tables[i] for i in order])

        # which rows need logits: the last token of each request that reached its end,
        # plus every scheduled position of requests asking for prompt logprobs
        sample_rows = [row for row, r in enumerate(reqs) if seq_lens[row] == r.num_tokens]
        logits_idx = [int(query_start_loc[row + 1]) - 1 for row in sample_rows]
        sampled_by_row: dict[int, int] = {}
        logprobs_by_row: dict[int, Optional[TokenLogprobs]] = {}
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(logits_idx)])
            out = self.sampler(logits, [reqs[row] for row in sample_rows])
            for j, row in enumerate(sample_rows):
                sampled_by_row[row] = out.token_ids[j]
                logprobs_by_row[row] = out.logprobs[j] if out.logprobs else None
        prompt_lp_by_row = self._prompt_logprobs(reqs, starts, num_new, query_start_loc, hidden)

        inverse = {i: row for row, i in enumerate(order)}
        return RunnerOutput(
            sampled_token_ids=[sampled_by_row.get(inverse[i]) for i in range(n)],
            logprobs=[logprobs_by_row.get(inverse[i]) for i in range(n)],
            prompt_logprobs=[prompt_lp_by_row.get(inverse[i]) for i in range(n)],
        )

    def forward(self, input_ids: np.ndarray, starts: np.ndarray, num_new: np.ndarray, num_decodes: int,
                block_tables_list: list[list[int]], model: Optional[torch.nn.Module] = None,
                kv_caches: Optional[list[torch.Tensor]] = None, backend: Any = None
                ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """Run the model over one flattened batch (requests ``[0, num_decodes)`` have one token each).

        ``input_ids``: ``[num_tokens]``; ``starts``, ``num_new``: ``[num_reqs]`` int64 (first position
        and token count per request). Returns hidden states ``[num_tokens, hidden]``,
        ``query_start_loc`` ``[num_reqs + 1]`` and ``seq_lens`` ``[num_reqs]``. ``model`` and
        ``kv_caches`` and ``backend`` default to the target's (a speculative draft passes its own).
        """
        n = len(starts)
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        req_of_token = np.repeat(np.arange(n), num_new)
        positions = np.arange(num_tokens) - query_start_loc[req_of_token] + starts[req_of_token]
        seq_lens = starts + num_new
        max_blocks = max(len(t) for t in block_tables_list)
        block_tables = np.zeros((n, max_blocks), dtype=np.int64)
        for row, table in enumerate(block_tables_list):
            block_tables[row, :len(table)] = table
        slot_mapping = block_tables[req_of_token, positions // self.block_size] * self.block_size + \
            positions % self.block_size

        batch = AttentionBatch(
            num_reqs=n,
            num_decodes=num_decodes,
            num_tokens=num_tokens,
            query_start_loc=torch.from_numpy(query_start_loc).to(torch.int32),
            seq_lens=torch.from_numpy(seq_lens).to(torch.int32),
            block_tables=torch.from_numpy(block_tables).to(torch.int32),
            slot_mapping=torch.from_numpy(slot_mapping),
            query_start_loc_list=query_start_loc.tolist(),
            seq_lens_list=seq_lens.tolist(),
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=self.block_size,
        )
        metadata = (self.backend if backend is None else backend).build_metadata(batch)
        hidden = (self.model if model is None else model)(
            torch.from_numpy(np.asarray(input_ids, dtype=np.int64)).to(self.device),
            torch.from_numpy(positions).to(self.device),
            self.kv_caches if kv_caches is None else kv_caches,
            metadata,
        )
        return hidden, query_start_loc, seq_lens

    def _prompt_logprobs(self, reqs: list[Request], starts, num_new, query_start_loc,
                         hidden: torch.Tensor) -> dict[int, list[TokenLogprobs]]:
        result = {}
        for row, r in enumerate(reqs):
            num_top = r.sampling_params.prompt_logprobs
            start = int(starts[row])
            if num_top is None or start >= r.num_prompt_tokens - 1:
                continue
            # position p predicts prompt token p + 1; only prompt positions count
            end = min(start + int(num_new[row]), r.num_prompt_tokens - 1)
            if end <= start:
                continue
            q0 = int(query_start_loc[row])
            rows = hidden[q0:q0 + (end - start)]
            logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
            result[row] = prompt_logprobs_for(logprobs, r.prompt_token_ids[start + 1:end + 1], num_top)
        return result


def _raw_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A one-byte (fp8) cache seen as uint8, so block copies work on every device; others unchanged."""
    return cache.view(torch.uint8) if cache.element_size() == 1 and cache.is_floating_point() else cache
