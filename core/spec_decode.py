"""Speculative decoding: the verify step, the draft budget per request, and acceptance counters.

With speculation on, the scheduler gives a decoding request ``1 + k`` tokens
(its last real token plus k draft slots, see :meth:`Speculator.max_drafts`);
the proposer fills the slots with draft tokens, the target scores all of them
in the same forward pass as the rest of the batch, and the rejection sampler
keeps an accepted prefix plus one token. ``scheduler.update`` then appends
that run and rolls the request's KV back to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from pagoda.config import EngineConfig
from pagoda.errors import ConfigError
from pagoda.rejection_sampler import RejectionSampler, is_speculation_safe
from pagoda.request import Request
from pagoda.scheduler_output import SchedulerOutput

logger = logging.getLogger("pagoda")


@dataclass
class SpecDecodeStats:
    """Acceptance counters (vLLM's ``spec_decode_*`` metrics): written by the engine thread only."""

    num_speculative_tokens: int
    num_drafts: int = 0  # verify runs: one per request per step that carried at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [k]: how often the draft at position j (0-based) was accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify run: accepted drafts plus the corrected or bonus token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    """The runner's speculative step: propose, verify in one forward pass, rejection-sample."""

    def __init__(self, config: EngineConfig, runner: Any, proposer: Any, stats: SpecDecodeStats) -> None:
        self.runner = runner
        self.proposer = proposer
        self.stats = stats
        self.num_speculative_tokens = config.speculative.num_speculative_tokens
        self.rejection_sampler = RejectionSampler(config.model.seed)

    def max_drafts(self, req: Request) -> int:
        """How many draft tokens a decoding request may verify this step (the scheduler caps it further
        by the step's budget, ``max_model_len`` and free blocks)."""
        params = req.sampling_params
        if not is_speculation_safe(req):
            return 0
        k = self.num_speculative_tokens
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - req.num_output_tokens - 1)  # no drafts past the last token
        return k

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput):
        from pagoda.model_runner import RunnerOutput

        runner = self.runner
        n = len(sched.requests)
        requests = sched.requests
        # a request scheduled past its known tokens is verifying drafts: 1 real token + k slots
        spec = [i for i in range(n) if sched.num_computed_before[i] + sched.num_new_tokens[i] > requests[i].num_tokens]
        drafts: dict[int, list[int]] = {}
        draft_probs: dict[int, Optional[torch.Tensor]] = {}
        # called every step: a draft model with its own KV cache also computes this step's other tokens
        proposed, probs = self.proposer.propose(sched, spec, [sched.num_new_tokens[i] - 1 for i in spec])
        for i, ids, q in zip(spec, proposed, probs):
            if ids:
                drafts[i] = ids
                draft_probs[i] = q
        num_new_list = list(sched.num_new_tokens)
        for i in spec:  # fewer drafts than slots (n-gram found no match): the slots stay unused
            num_new_list[i] = 1 + len(drafts.get(i, ()))
        # decodes first: the backends treat requests [0, num_decodes) as one-token queries
        order = sorted(range(n), key=lambda i: num_new_list[i] != 1)
        reqs = [requests[i] for i in order]
        num_new = np.array([num_new_list[i] for i in order], dtype=np.int64)
        starts = np.array([sched.num_computed_before[i] for i in order], dtype=np.int64)
        num_decodes = int((num_new == 1).sum())
        pieces = []
        for i, r, s, k in zip(order, reqs, starts.tolist(), num_new.tolist()):
            pieces.append([r.all_token_ids[-1]] + drafts[i] if i in drafts else r.all_token_ids[s:s + k])
        input_ids = np.fromiter((t for p in pieces for t in p), dtype=np.int64)
        hidden, query_start_loc, seq_lens = runner.forward(input_ids, starts, num_new, num_decodes,
                                                           [sched.block_tables[i] for i in order])

        result: dict[int, Any] = {}
        logprobs: dict[int, Any] = {}
        # requests sampling one token the ordinary way (prefill ends, decodes without drafts)
        plain = [row for row, i in enumerate(order) if i not in drafts and seq_lens[row] == reqs[row].num_tokens]
        if plain:
            logits = runner.model.compute_logits(hidden[torch.tensor([int(query_start_loc[r + 1]) - 1 for r in plain])])
            out = runner.sampler(logits, [reqs[row] for row in plain])
            spec_set = set(spec)
            for j, row in enumerate(plain):
                i = order[row]
                # a list tells scheduler.update to roll the request back from its unused draft slots
                result[i] = [out.token_ids[j]] if i in spec_set else out.token_ids[j]
                logprobs[i] = out.logprobs[j] if out.logprobs else None
        verify = [row for row, i in enumerate(order) if i in drafts]
        if verify:
            idx = np.concatenate([np.arange(query_start_loc[r], query_start_loc[r + 1]) for r in verify])
            logits = runner.model.compute_logits(hidden[torch.from_numpy(idx)])  # [sum(k_i + 1), vocab]
            row_starts = np.concatenate([[0], np.cumsum(num_new[verify])[:-1]]).tolist()
            verdicts = self.rejection_sampler(logits, row_starts, [reqs[r] for r in verify],
                                              [drafts[order[r]] for r in verify],
                                              [draft_probs[order[r]] for r in verify])
            for row, verdict in zip(verify, verdicts):
                result[order[row]] = verdict.token_ids
                self.stats.observe(len(drafts[order[row]]), verdict.num_accepted)
        prompt_lp = runner._prompt_logprobs(reqs, starts, num_new, query_start_loc, hidden)
        row_of = {i: row for row, i in enumerate(order)}
        return RunnerOutput(
            sampled_token_ids=[result.get(i) for i in range(n)],
            logprobs=[logprobs.get(i) for i in range(n)],
            prompt_logprobs=[prompt_lp.get(row_of[i]) for i in range(n)],
        )


def enable_speculation(config: EngineConfig, plugin_manager: Any, runner: Any, scheduler: Any) -> SpecDecodeStats:
    """Build the configured proposer and hook speculation into the runner and the scheduler."""
    spec = config.speculative
    if spec.num_speculative_tokens < 1:
        raise ConfigError(
            f"speculative_config num_speculative_tokens={spec.num_speculative_tokens}; pass at least 1 "
            "(or leave speculative_config out to decode one token per step)"
        )
    factory = plugin_manager.get("pagoda_proposers", spec.method, "speculative_config method").factory
    proposer = factory(spec, config, runner, plugin_manager)
    stats = SpecDecodeStats(spec.num_speculative_tokens)
    speculator = Speculator(config, runner, proposer, stats)
    runner.speculator = speculator
    scheduler.max_spec_tokens = speculator.max_drafts
    logger.info("speculative decoding: %s, %d draft tokens per step", spec.method, spec.num_speculative_tokens)
    return stats
