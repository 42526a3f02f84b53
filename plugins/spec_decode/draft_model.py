"""The ``draft_model`` proposer: a smaller model sharing the target's vocabulary drafts k tokens per step.

Two kinds of draft:

- ``"model": "self:layers=N"`` (self-speculation): the target's own first N
  layers, its final norm and LM head (the target run with only its first N
  layers' caches runs only those layers). Those N layers see exactly the target's
  inputs, so the K/V they would store for accepted tokens are the target's:
  the draft reads and writes the target's cache for layers ``< N``. Its writes
  at draft positions land in slots the target's verify pass overwrites in the
  same step, so preemption, swap, copy-on-write and prefix caching need
  nothing extra.
- ``"model": "/path/to/checkpoint"``: a separate model with its own paged KV
  cache, indexed by the target's block ids (same block tables, so preemption,
  abort, swap and prefix caching move both together). It computes every token
  the target computes in the step (prefill chunks included) before drafting,
  and feeds its last draft too, so its cache holds every token that can be
  accepted.

Drafting runs k one-token decode passes of the draft over the requests being
speculated. Greedy requests take the draft's argmax; sampled ones draw from
the draft's distribution after the request's temperature / top-k / top-p /
min-p and hand those probabilities to the rejection sampler.

A request under a grammar (structured outputs) drafts inside it: a fork of its
matcher masks the draft's logits at each position before the draft is chosen,
as the target's are masked when it verifies, and drafting stops at the
grammar's end. The fork is dropped after the step.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import numpy as np
import torch

from pagoda.config import EngineConfig, SpeculativeConfig
from pagoda.execution.build import select_attention_backend
from pagoda.engine.engine_args import EngineArgs
from pagoda.errors import ConfigError
from pagoda.host import malloc
from pagoda.host.dtypes import stored_kv_dtype
from pagoda.execution.model_runner import FlatBatch
from pagoda.registry.adapt import adapt_component
from pagoda.sampling.rejection_sampler import target_probs, with_bias
from pagoda.sampling.sampler import _generator_for
from pagoda.sampling.structured.speculative import DraftGrammars
from pagoda.sequence import Sequence
from pagoda.step import SchedulerOutput


class DraftModelProposer:
    """Drafts with a small model: the target's first layers (``self:layers=N``) or a checkpoint."""

    def __init__(self, speculative_config: SpeculativeConfig, engine_config: EngineConfig, runner: Any,
                 plugin_manager: Any) -> None:
        self.runner = runner
        # draft noise for unseeded sampled requests (seeded ones use their own generator)
        self.generator = torch.Generator().manual_seed(engine_config.model.seed)
        self.vocab_size = engine_config.model.vocab_size
        # every rank drafts the same tokens: only rank 0 holds the matchers, so drafts are steered by the
        # grammar only when there is no other rank
        self.steers_drafts = engine_config.parallel.world_size == 1
        name = speculative_config.model
        if not name:
            raise ConfigError(
                'speculative_config method "draft_model" needs "model": a checkpoint directory sharing the '
                'target\'s tokenizer, or "self:layers=N" for the target\'s own first N layers'
            )
        if name.startswith("self:"):
            self.model, self.kv_caches, self.backend = self._self_draft(name, runner)
            self.has_own_cache = False
        else:
            self.model, self.kv_caches, self.backend = self._checkpoint_draft(name, engine_config, runner,
                                                                             plugin_manager)
            self.has_own_cache = True
            runner.add_draft_kv_caches(self.kv_caches)

    @staticmethod
    def _self_draft(name: str, runner: Any):
        match = re.fullmatch(r"self:layers=(\d+)", name)
        total = len(runner.kv_caches)
        if match is None or not 1 <= int(match.group(1)) < total:
            raise ConfigError(
                f'speculative_config model {name!r} is not understood; use "self:layers=N" with '
                f"1 <= N < {total} (the target's layer count), e.g. \"self:layers={max(1, total // 4)}\""
            )
        if not runner.model.runs_first_layers_of_caches:
            raise ConfigError(f"self-speculation needs a target that can run its first N layers alone "
                              f"({type(runner.model).__name__} cannot); pass a draft checkpoint directory instead")
        num_layers = int(match.group(1))
        return runner.model, runner.kv_caches[:num_layers], runner.backend

    @staticmethod
    def _checkpoint_draft(path: str, engine_config: EngineConfig, runner: Any, pm: Any):
        target = engine_config.model
        args = EngineArgs.build(model=path, dtype=str(target.dtype).replace("torch.", ""),
                                max_model_len=target.max_model_len, seed=target.seed)
        # the target's host settings (kernels, threads) and batch-invariant mode: a draft of the same checkpoint
        # then computes each token as the target does
        mc = dataclasses.replace(args.create_engine_config().model, host=target.host,
                                 batch_invariant=target.batch_invariant)
        if mc.vocab_size != target.vocab_size:
            raise ConfigError(
                f"the draft model at {path} has a vocabulary of {mc.vocab_size} tokens but the target has "
                f"{target.vocab_size}; a draft must share the target's tokenizer"
            )
        arch = pm.get("pagoda_model_architectures", mc.architecture, "the draft checkpoint's architectures")
        loader = pm.get("pagoda_model_loaders", mc.load_format, "load_format").factory
        # the draft gets a backend of the kind the target got, built for the draft's own shapes
        backend = select_attention_backend(dataclasses.replace(engine_config, model=mc), pm)
        with torch.device(engine_config.device):
            model = adapt_component(arch.factory(mc, backend, None), "pagoda_model_architectures", arch.name)
        loader(mc).load_weights(model)
        model.eval()
        kv_dtype = stored_kv_dtype(backend, mc.dtype)
        shape = backend.kv_cache_shape(runner.num_blocks)
        if torch.device(engine_config.device).type == "cpu":  # zero pages, as the target's (ModelRunner)
            caches = [malloc.zero_pages(tuple(shape), kv_dtype) for _ in range(mc.num_layers)]
        else:
            caches = [torch.zeros(shape, dtype=kv_dtype, device=engine_config.device) for _ in range(mc.num_layers)]
        return model, caches, backend

    # ---- drafting ---------------------------------------------------------------

    def propose(self, sched: SchedulerOutput) -> tuple[list[list[int]], list[Optional[torch.Tensor]]]:
        """Up to ``sched.num_draft_slots[i]`` drafts for each request (a request with slots is decoding: its
        last token sits at position ``num_tokens - 1`` and its blocks hold room for the drafts), and for
        sampled requests the draft distributions ``[k_i, vocab]`` (None for greedy ones)."""
        n = len(sched.requests)
        drafts: list[list[int]] = [[] for _ in range(n)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        rows = [i for i in range(n) if sched.num_draft_slots[i]]
        max_drafts = [sched.num_draft_slots[i] for i in rows]
        reqs = [sched.requests[i] for i in rows]
        tables = [sched.block_tables[i] for i in rows]
        row_drafts = [drafts[i] for i in rows]
        row_probs = [probs[i] for i in rows]
        grammars = DraftGrammars([r.grammar if self.steers_drafts else None for r in reqs], self.vocab_size)
        if self.has_own_cache:
            logits = self._catch_up(sched, rows)  # [len(rows), vocab], the first draft position
            if not rows:
                return drafts, [None] * n
            tokens = self._choose(logits, reqs, list(range(len(rows))), row_drafts, row_probs, grammars, max_drafts)
        elif not rows:
            return drafts, [None] * n
        else:
            tokens = np.array([r.all_token_ids[-1] for r in reqs], dtype=np.int64)
        lengths = [r.num_tokens for r in reqs]
        first = 1 if self.has_own_cache else 0
        # an own-cache draft also feeds its last draft (logits unused), so that if every draft is
        # accepted its cache still holds them all: blocks may be cached or preempted before next step
        end = max(max_drafts) + (1 if self.has_own_cache else 0)
        for j in range(first, end):
            active = [a for a in range(len(rows)) if max_drafts[a] > j or (self.has_own_cache and max_drafts[a] == j)]
            if not active:  # every row's grammar ended its drafts early
                break
            # one-token decode pass: row a feeds its newest token at position num_tokens - 1 + j
            batch = FlatBatch([[int(tokens[a])] for a in active], [lengths[a] - 1 + j for a in active],
                              [tables[a] for a in active], self.runner.block_size)
            hidden = self.runner.forward(batch, self.model, self.kv_caches, self.backend)
            choosing = [c for c, a in enumerate(active) if max_drafts[a] > j]
            if choosing:
                logits = self.model.compute_logits(hidden[torch.tensor([batch.last_row(c) for c in choosing])])
                rows_now = [active[c] for c in choosing]
                tokens[rows_now] = self._choose(logits, reqs, rows_now, row_drafts, row_probs, grammars, max_drafts)
        return drafts, [torch.stack(p) if p else None for p in probs]

    def _choose(self, logits: torch.Tensor, reqs: list[Sequence], active: list[int], drafts: list[list[int]],
                probs: list[list[torch.Tensor]], grammars: DraftGrammars, max_drafts: list[int]) -> np.ndarray:
        """Pick each active row's next draft token from ``logits`` ``[len(active), vocab]``, inside its grammar
        if it has one; a row whose grammar allows nothing after its draft gets no more (``max_drafts``)."""
        grammars.mask_(logits, active)
        chosen = logits.argmax(dim=-1).tolist()
        for j, a in enumerate(active):
            params = reqs[a].sampling_params
            if params.is_greedy:
                if params.logit_bias:
                    chosen[j] = int(with_bias(logits[j:j + 1], params).argmax())
            else:
                q = target_probs(logits[j:j + 1], params)[0]  # [vocab]
                noise = torch.empty_like(q).exponential_(generator=_generator_for(reqs[a], self.generator))
                chosen[j] = int((q / noise).argmax())
                probs[a].append(q)
            drafts[a].append(chosen[j])
            if not grammars.accept(a, chosen[j]):
                max_drafts[a] = len(drafts[a])
        return np.array(chosen, dtype=np.int64)

    def _catch_up(self, sched: SchedulerOutput, rows: list[int]) -> torch.Tensor:
        """Own-cache draft: compute the step's known tokens into the draft's cache, as the target does into
        its own (a request with draft slots: its last token). Returns logits at each such request's
        last token, ``[len(rows), vocab]``."""
        pieces = []
        starts = []
        for i, req in enumerate(sched.requests):
            start = sched.num_computed_before[i]
            pieces.append(req.all_token_ids[start:start + sched.num_real_tokens(i)])
            starts.append(start)
        batch = FlatBatch(pieces, starts, sched.block_tables, self.runner.block_size)
        hidden = self.runner.forward(batch, self.model, self.kv_caches, self.backend)
        if not rows:
            return torch.empty(0)
        return self.model.compute_logits(hidden[torch.tensor([batch.last_row(i) for i in rows])])
