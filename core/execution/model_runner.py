"""Turns a schedule into tensors, runs the model, samples (and verifies drafts). Keeps no books of its own."""

from __future__ import annotations

import contextlib
import time
import typing
from typing import Any, Optional

import numpy as np
import torch

from pagoda.config import EngineConfig
from pagoda.errors import ConfigError
from pagoda.execution import distributed
from pagoda.execution.window_pool import WindowPoolPlan
from pagoda.host import hugepages, malloc
from pagoda.host.dtypes import stored_kv_dtype
from pagoda.kv.connector import read_block, write_block
from pagoda.kv.offload import KVTierStore, fingerprint
from pagoda.sampling.rejection_sampler import RejectionSampler
from pagoda.sampling.structured.after_reasoning import is_waiting
from pagoda.sampling.structured.bitmask import allocate_bitmask, apply_bitmask_
from pagoda.sampling.structured.speculative import fill_draft_rows
from pagoda.sampling.sampler import prompt_logprobs_for
from pagoda.step import AttentionBatch, KVTierMoves, PoolMetadata, RunnerOutput, SchedulerOutput


class ModelRunner:
    """Owns the model, the KV tensors and the sampler; executes one step at a time."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, backend: Any, sampler: Any,
                 num_blocks: int, window_pool: Optional[WindowPoolPlan] = None) -> None:
        """``window_pool``: the split of the KV cache when the sliding-window layers keep theirs in a pool of
        their own (None: every layer has ``num_blocks`` blocks)."""
        self.config = config
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.block_size = config.cache.block_size
        self.device = torch.device(config.device)
        self.num_blocks = num_blocks
        self.window_pool = window_pool
        kv_dtype = stored_kv_dtype(backend, config.model.dtype)
        # pipeline parallelism: this process's stage, which keeps the K/V of its own layers only
        self.stage = distributed.current_stage()
        # zeros (masked-out slots are multiplied by 0 and must not hold NaN); on the CPU zero pages the kernel
        # maps on first touch, so a start writes nothing and only the blocks in use become resident; huge pages
        # are asked for before that first touch (the weights' were, by build_runner, before they were loaded)
        num_layers = self.stage.num_layers(config.model.num_layers)
        window_layers = window_pool.layers if window_pool is not None else frozenset()
        shapes = [tuple(backend.kv_cache_shape(window_pool.num_slots + 1 if i in window_layers else num_blocks))
                  for i in range(num_layers)]
        if self.device.type == "cpu":
            self.kv_caches = [malloc.zero_pages(shape, kv_dtype) for shape in shapes]
        else:
            self.kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=self.device) for shape in shapes]
        # the caches block moves of the main block ids apply to, and those of the window pool's slots
        self._main_caches = [c for i, c in enumerate(self.kv_caches) if i not in window_layers]
        self._window_caches = [c for i, c in enumerate(self.kv_caches) if i in window_layers]
        if config.host.huge_pages:
            hugepages.advise_tensors(self.kv_caches)
        # seconds the kernel took to map the whole CPU cache at start (None: it maps blocks as they are first used)
        self.prefault_seconds: Optional[float] = None
        if self.device.type == "cpu" and config.host.kv_cache_prefault:
            self.prefault_seconds = hugepages.populate(self.kv_caches)
        # the block axis of the backend's layout, found by asking for a 1-block and a 2-block shape
        one, two = backend.kv_cache_shape(1), backend.kv_cache_shape(2)
        self.block_dim = next(i for i, (a, b) in enumerate(zip(one, two)) if a != b)
        self.swap_caches: Optional[list[torch.Tensor]] = None
        self.num_swap_blocks = 0
        # a speculative draft model's own KV tensors, indexed by the same block ids (moved with the target's)
        self.draft_kv_caches: list[torch.Tensor] = []
        # speculative decoding: fills the schedule's draft slots (see set_proposer)
        self.proposer: Any = None
        self.rejection_sampler: Optional[RejectionSampler] = None
        # the prefix cache's offload tiers (RAM, disk), when on (see init_offload)
        self.kv_tiers: Optional[KVTierStore] = None
        # cache blocks a tier load of this step failed to fill: recomputed before the step's forward pass
        self._failed_load_blocks: list[int] = []
        # multi-LoRA serving, when enabled: the adapters and their slots (pagoda.execution.lora: a LoRAManager on
        # rank 0, a LoRAFollower of it on the other ranks)
        self.lora: Any = None
        # pipeline stages: whether this step's hand-offs happened (a failed step completes them with placeholders)
        self._has_received = self._has_sent = False
        # seconds the last execute spent per part: draft, metadata, model, logits, grammar (the structured-output
        # mask), sampling
        self.timings: dict[str, float] = {}

    def set_proposer(self, proposer: Any) -> None:
        """Turn speculative decoding on: ``proposer.propose(sched)`` fills each request's draft slots
        (``SchedulerOutput.num_draft_slots``) and the runner verifies the drafts by rejection sampling."""
        self.proposer = proposer
        self.rejection_sampler = RejectionSampler(self.config.model.seed)

    def allocate_swap_space(self, num_swap_blocks: int) -> None:
        """CPU memory for swapped-out blocks, laid out like the cache itself."""
        if self.window_pool is not None:
            raise ConfigError("swap preemption moves whole blocks of every layer, which the KV window pool keeps "
                              "apart; pass --kv-window-pool off or --preemption-mode recompute")
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

    def init_offload(self, num_ram_slots: int, disk_dir: Optional[str], num_disk_blocks: int) -> KVTierStore:
        """Keep evicted prefix blocks in ``num_ram_slots`` CPU slots, then in block files under ``disk_dir``."""
        if self.draft_kv_caches:
            raise ConfigError("KV offload does not move a draft model's own KV cache; drop the --kv-offload-* "
                              "flags or use a speculative method without a draft model (ngram)")
        tp = distributed.current()
        identity = fingerprint(self.config, self.backend, tp.rank, tp.size)
        self.kv_tiers = KVTierStore(self.kv_caches, self.block_dim, self.block_size, num_ram_slots, disk_dir,
                                    num_disk_blocks, identity)
        return self.kv_tiers

    def move_blocks(self, sched: SchedulerOutput) -> list[int]:
        """Swap out, offload-tier moves, swap in, then copy-on-write, for every layer. Returns the block
        hashes of tier loads that failed their check on any rank (their tokens are recomputed)."""
        self._move(sched.blocks_to_swap_out, "out")
        failed = self._move_tiers(sched.kv_tier_moves)
        self._move(sched.blocks_to_swap_in, "in")
        self._move(sched.blocks_to_copy, "copy")
        self._move(sched.window_blocks_to_copy, "copy", self._window_caches)
        return failed

    def _move_tiers(self, moves: KVTierMoves) -> list[int]:
        self._failed_load_blocks = []
        if not moves:
            return []
        failed = set(self.kv_tiers.apply(moves))
        loads = moves.disk_to_blocks
        tp = distributed.current()
        if tp.size > 1 and loads:
            # every rank recomputes the same blocks (the recompute pass joins the model's collectives)
            flags = tp.all_reduce(torch.tensor([h in failed for h, _ in loads], dtype=torch.int32), "kv_offload")
            failed = {h for (h, _), bad in zip(loads, flags.tolist()) if bad}
            self.kv_tiers.discard(sorted(failed))
        self._failed_load_blocks = [block for h, block in loads if h in failed]
        return [h for h, _ in loads if h in failed]

    def _recompute_failed_loads(self, sched: SchedulerOutput) -> None:
        """Fill blocks a tier load left empty by running their tokens through the model (K/V written, the
        hidden states dropped): one piece per run of such blocks in a request's table, each block once."""
        bad, bs = set(self._failed_load_blocks), self.block_size
        pieces, starts, tables = [], [], []
        for req, table, start in zip(sched.requests, sched.block_tables, sched.num_computed_before):
            for p in range(start // bs):
                if table[p] not in bad:
                    continue
                bad.discard(table[p])
                if starts and tables[-1] is table and starts[-1] + len(pieces[-1]) == p * bs:
                    pieces[-1] = pieces[-1] + req.all_token_ids[p * bs:(p + 1) * bs]  # extends the run
                else:
                    pieces.append(req.all_token_ids[p * bs:(p + 1) * bs])
                    starts.append(p * bs)
                    tables.append(table)
        if pieces:
            self.forward(FlatBatch(pieces, starts, tables, bs))
        self._failed_load_blocks = []

    def _move(self, pairs: list[tuple[int, int]], kind: str, caches: Optional[list[torch.Tensor]] = None) -> None:
        """One kind of block move ("out": cache to swap, "in": swap to cache, "copy": within the cache) over
        ``caches`` (default: those indexed by the main block ids: every layer's but the window pool's, and a
        draft model's)."""
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], dtype=torch.int64)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.int64)
        for layer, cache in enumerate(self._main_caches + self.draft_kv_caches if caches is None else caches):
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
        """Run one step's forward pass and sampling (block moves are :meth:`move_blocks`, done first).

        Writes K/V only at the step's new positions, so running the same schedule again gives the
        same result: the engine re-runs parts of a step whose execution raised.

        On a pipeline stage that raises, the stage still takes the previous stage's hand-off and gives the
        next one a placeholder, so the stages stay in step for the re-run (the step's result is dropped).
        """
        if self.stage.num_stages == 1:
            return self._execute(sched)
        self._has_received = self._has_sent = False
        try:
            return self._execute(sched)
        except BaseException:
            self._hand_off_placeholder(sched.num_batched_tokens)
            raise

    def _hand_off_placeholder(self, num_tokens: int) -> None:
        stage, mc = self.stage, self.config.model
        if not stage.is_first and not self._has_received:
            stage.receive(num_tokens, mc.hidden_size, mc.dtype, self.device)
        if not stage.is_last and not self._has_sent:
            zeros = torch.zeros((num_tokens, mc.hidden_size), dtype=mc.dtype, device=self.device)
            stage.send(zeros, zeros)

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        n = len(sched.requests)
        out = RunnerOutput.empty(n)
        clock = time.perf_counter
        self.timings = timings = dict.fromkeys(("draft", "metadata", "model", "logits", "grammar", "sampling"), 0.0)
        if n == 0:
            return out
        if sched.kv_connector.loads:  # blocks a KV connector loaded, verified: into the cache first
            for block, payload in sched.kv_connector.loads:
                write_block(self.kv_caches, self.block_dim, block, payload)
        if self._failed_load_blocks:
            self._recompute_failed_loads(sched)
        reqs = sched.requests
        if self.proposer is not None:
            t = clock()
            # called every step: a draft model with its own KV cache also computes this step's other tokens
            drafts, draft_probs = self.proposer.propose(sched)
            timings["draft"] = clock() - t
        else:
            drafts, draft_probs = [[] for _ in range(n)], [None] * n
        pieces = []
        for i, r in enumerate(reqs):
            start = sched.num_computed_before[i]
            # the known tokens; a request with draft slots then its drafts (fewer than the slots if
            # the proposer found fewer: the other slots stay unused)
            pieces.append(r.all_token_ids[start:start + sched.num_real_tokens(i)] + drafts[i])
        batch = FlatBatch(pieces, sched.num_computed_before, sched.block_tables, self.block_size,
                          [r.num_prompt_tokens for r in reqs], sched.window_block_tables or None)
        t = clock()
        metadata = self.backend.build_metadata(batch.attention)
        if batch.window_attention is not None:
            metadata = PoolMetadata(metadata, self.backend.build_metadata(batch.window_attention))
        t1 = clock()
        if self.lora is not None:
            self.lora.begin_pass([r.lora_request for r in reqs], batch.lengths, batch.order)
        try:
            hidden = self.forward(batch, metadata=metadata)
        finally:
            if self.lora is not None:
                self.lora.end_pass()
        t2 = clock()
        timings["metadata"], timings["model"] = t1 - t, t2 - t1
        if sched.kv_connector.saves:  # a finished prefill's blocks, for the KV connector to save
            out.kv_saved = [(h, read_block(self.kv_caches, self.block_dim, block))
                            for block, h in sched.kv_connector.saves]
        if hidden is None:  # a pipeline stage before the last: its hidden states went on to the next
            return out

        # one token for each request that reached its last known token and has no drafts
        plain = [i for i in range(n) if not drafts[i]
                 and sched.num_computed_before[i] + sched.num_real_tokens(i) == reqs[i].num_tokens]
        # every position of a verified run is scored: the last known token and each draft
        verify = [i for i in range(n) if drafts[i]]
        if plain or verify:
            # one LM-head pass over the step's scored rows: the plain requests' last rows, then the verified runs
            idx = [batch.last_row(i) for i in plain] + [row for i in verify for row in batch.rows(i)]
            t = clock()
            logits = self.model.compute_logits(hidden[torch.tensor(idx)])  # [len(plain) + sum(k_i + 1), vocab]
            timings["logits"] = clock() - t
            if sched.grammar_rows or any(_starts_grammar(sched.requests[i].grammar, drafts[i]) for i in verify):
                t = clock()
                _apply_grammar(logits, plain, verify, drafts, sched)
                timings["grammar"] = clock() - t
        if plain:
            t = clock()
            sampled = self.sampler(logits[:len(plain)], [reqs[i] for i in plain])
            timings["sampling"] += clock() - t
            for j, i in enumerate(plain):
                out.sampled_token_ids[i] = [sampled.token_ids[j]]
                out.logprobs[i] = sampled.logprobs[j] if sampled.logprobs else None
        if verify:
            t = clock()
            row_starts = np.concatenate([[0], np.cumsum([len(drafts[i]) + 1 for i in verify])[:-1]]).tolist()
            verdicts = self.rejection_sampler(logits[len(plain):], row_starts, [reqs[i] for i in verify],
                                              [drafts[i] for i in verify], [draft_probs[i] for i in verify])
            for i, verdict in zip(verify, verdicts):
                out.sampled_token_ids[i] = verdict.token_ids
                out.num_draft_tokens[i] = len(drafts[i])
            timings["sampling"] += clock() - t
        self._prompt_logprobs(sched, batch, hidden, out)
        return out

    def forward(self, batch: FlatBatch, model: Optional[torch.nn.Module] = None,
                kv_caches: Optional[list[torch.Tensor]] = None, backend: Any = None, metadata: Any = None
                ) -> Optional[torch.Tensor]:
        """Run the model over one flattened batch; returns hidden states ``[num_tokens, hidden]`` in the
        batch's row order (:meth:`FlatBatch.rows`). ``model``, ``kv_caches`` and ``backend`` default to
        the target's (a speculative draft passes its own); ``metadata`` to the backend's for ``batch``.

        On a pipeline stage, the stage's layers only: a stage after the first starts from the previous
        one's hidden states and residual, and a stage before the last sends its own on and returns None."""
        if metadata is None:
            metadata = (self.backend if backend is None else backend).build_metadata(batch.attention)
        args = (torch.from_numpy(batch.input_ids).to(self.device), torch.from_numpy(batch.positions).to(self.device),
                self.kv_caches if kv_caches is None else kv_caches, metadata)
        # a step that computes prompt tokens multiplies them as a cold prompt's would be, at any row count
        prompt_step = getattr(self.model if model is None else model, "prompt_step", None)
        with (prompt_step() if prompt_step is not None and batch.computes_prompt else contextlib.nullcontext()):
            return self._run_stage(batch, args, model)

    def _run_stage(self, batch: FlatBatch, args: tuple, model: Optional[torch.nn.Module]) -> Optional[torch.Tensor]:
        stage = self.stage
        if stage.num_stages == 1:
            return (self.model if model is None else model)(*args)
        received = None
        if not stage.is_first:
            received = stage.receive(batch.attention.num_tokens, self.config.model.hidden_size,
                                     self.config.model.dtype, self.device)
            self._has_received = True
        hidden = self.model(*args, intermediate=received)
        if stage.is_last:
            return hidden
        stage.send(*hidden)  # (hidden states, residual)
        self._has_sent = True
        return None

    def _prompt_logprobs(self, sched: SchedulerOutput, batch: FlatBatch, hidden: torch.Tensor,
                         out: RunnerOutput) -> None:
        for i, r in enumerate(sched.requests):
            num_top = r.sampling_params.prompt_logprobs
            start = sched.num_computed_before[i]
            if num_top is None or start >= r.num_prompt_tokens - 1:
                continue
            # position p predicts prompt token p + 1; only prompt positions count
            end = min(start + sched.num_real_tokens(i), r.num_prompt_tokens - 1)
            if end <= start:
                continue
            first = batch.rows(i).start
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[first:first + (end - start)]), dim=-1)
            out.prompt_logprobs[i] = prompt_logprobs_for(logprobs, r.prompt_token_ids[start + 1:end + 1], num_top)


def _apply_grammar(logits: torch.Tensor, plain: list[int], verify: list[int], drafts: list[list[int]],
                   sched: SchedulerOutput) -> None:
    """Mask the scored rows of the requests that sample under a grammar, in one pass over the step's logits
    (``logits``: the rows of ``plain``, one each, then the k + 1 rows of each request of ``verify``). A row's
    first position takes the engine's bitmask row; a verified run's later positions the tokens the grammar
    allows after the drafts before them (filled here, the matcher left where it was). Other rows stay as
    they are."""
    engine_row = {i: k for k, i in enumerate(sched.grammar_rows)}
    logit_rows: list[int] = []  # the masked rows of ``logits``
    first_rows: list[tuple[int, int]] = []  # (row of the step's bitmask, row of the engine's bitmask)
    runs: list[tuple[int, int]] = []  # (request, row of the step's bitmask at its first scored position)
    for j, i in enumerate(plain):
        if i in engine_row:
            first_rows.append((len(logit_rows), engine_row[i]))
            logit_rows.append(j)
    start = len(plain)
    for i in verify:
        num_scored = len(drafts[i]) + 1
        if i in engine_row:
            first_rows.append((len(logit_rows), engine_row[i]))
            runs.append((i, len(logit_rows)))
            logit_rows.extend(range(start, start + num_scored))
        elif _starts_grammar(sched.requests[i].grammar, drafts[i]):
            # still thinking, and a draft ends the thinking: the drafts after it are held to the grammar
            runs.append((i, len(logit_rows)))
            logit_rows.extend(range(start, start + num_scored))
        start += num_scored
    if not logit_rows:
        return
    # [len(logit_rows), words], every token allowed until filled
    if sched.grammar_bitmask is not None:
        bitmask = sched.grammar_bitmask.new_full((len(logit_rows), sched.grammar_bitmask.shape[1]), -1)
    else:
        bitmask = allocate_bitmask(len(logit_rows), logits.shape[-1])
    if first_rows:
        bitmask[[r for r, _ in first_rows]] = sched.grammar_bitmask[[k for _, k in first_rows]]
    for i, row in runs:
        matcher = sched.requests[i].grammar
        if matcher is not None:  # None on the other ranks of a tensor-parallel model (rank 0's tokens count)
            fill_draft_rows(matcher, drafts[i], bitmask, row)
    index = torch.tensor(logit_rows)
    masked = logits[index]  # [len(logit_rows), vocab]
    apply_bitmask_(masked, bitmask)
    logits[index] = masked


def _starts_grammar(matcher: Any, draft_token_ids: list[int]) -> bool:
    """Whether a request still thinking before its grammar starts ends its thinking within these drafts."""
    return is_waiting(matcher) and matcher.starts_within(draft_token_ids)


class FlatBatch:
    """The one place a forward pass's batch is laid out: requests' tokens, decodes first, flattened.

    Built from one piece of tokens per request, in the caller's order (a plain
    step's new tokens, a verify pass's last token plus drafts, a draft pass's
    one token each). The attention backends treat requests ``[0, num_decodes)``
    as one-token queries, so one-token pieces go first; :meth:`rows` and
    :meth:`last_row` map hidden-state rows back to the caller's order.
    """

    def __init__(self, pieces: typing.Sequence[typing.Sequence[int]], starts: typing.Sequence[int],
                 block_tables: typing.Sequence[list[int]], block_size: int,
                 prompt_lens: Optional[typing.Sequence[int]] = None,
                 window_block_tables: Optional[typing.Sequence[list[int]]] = None) -> None:
        """``prompt_lens``: each request's prompt length (the caller's order), when the pieces are a step's
        tokens; then :attr:`computes_prompt` says whether any piece holds prompt tokens. ``window_block_tables``:
        the same requests' tables in the window pool, when it is on; then :attr:`window_attention` is the batch
        over them."""
        n = len(pieces)
        self.lengths = lengths = [len(p) for p in pieces]  # tokens per request, the caller's order
        # the requests in row order: request order[0]'s rows come first
        self.order = order = sorted(range(n), key=lambda i: lengths[i] != 1)
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

        def attention_batch(tables_of: typing.Sequence[list[int]]) -> AttentionBatch:
            tables = np.zeros((n, max(len(tables_of[i]) for i in order)), dtype=np.int64)
            for row, i in enumerate(order):
                tables[row, :len(tables_of[i])] = tables_of[i]
            slot_mapping = tables[req_of_token, self.positions // block_size] * block_size + \
                self.positions % block_size
            return AttentionBatch(
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
                prompt_lens_list=None if prompt_lens is None else [int(prompt_lens[i]) for i in order],
            )

        self.attention = attention_batch(block_tables)
        # the window layers' batch: the same tokens, their slots in the window pool
        self.window_attention = None if window_block_tables is None else attention_batch(window_block_tables)
        self.computes_prompt = prompt_lens is not None and any(
            lengths[i] and starts[i] < prompt_lens[i] for i in range(n))
        # request i (caller's order) -> its first row and row count in the hidden states
        self._first = [0] * n
        for row, i in enumerate(order):
            self._first[i] = int(query_start_loc[row])

    def rows(self, i: int) -> range:
        """Hidden-state rows of request ``i`` (the caller's order)."""
        return range(self._first[i], self._first[i] + self.lengths[i])

    def last_row(self, i: int) -> int:
        return self._first[i] + self.lengths[i] - 1


def _raw_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A one-byte (fp8) cache seen as uint8, so block copies work on every device; others unchanged."""
    return cache.view(torch.uint8) if cache.element_size() == 1 and cache.is_floating_point() else cache
