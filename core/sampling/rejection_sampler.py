"""Exact speculative sampling (Leviathan et al., 2023): accept or correct a run of draft tokens.

For one request with drafts ``d_1..d_k`` proposed from distributions
``q_1..q_k`` and the target's distributions ``p_1..p_{k+1}`` at the same
positions: ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``;
at the first rejection a token is drawn from ``max(p_j - q_j, 0)``
(normalised) and the run ends; when all k are accepted a bonus token is drawn
from ``p_{k+1}``. Every emitted token then follows the target's distribution
exactly. A proposer that picks tokens without a distribution (n-gram lookup)
has ``q_j`` = a point mass at ``d_j``. Greedy requests accept exactly while
the draft equals the target's argmax, so they emit the target's own tokens.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Optional

import torch

from pagoda.sampling.sampler import _apply_top_k_top_p, _generator_for
from pagoda.sampling_params import SamplingParams
from pagoda.sequence import Sequence


def with_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[n, vocab]`` logits plus the request's logit bias (a new tensor when there is one)."""
    if not params.logit_bias:
        return logits
    vocab = logits.shape[-1]
    ids = torch.tensor([t for t in params.logit_bias if t < vocab], dtype=torch.int64)
    vals = torch.tensor([params.logit_bias[t] for t in params.logit_bias if t < vocab], dtype=logits.dtype)
    logits = logits.clone()
    logits[:, ids] += vals
    return logits


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the default sampler draws from: ``[n, vocab]`` float32 logits -> probabilities.

    Logit bias, temperature, top-k / top-p and min-p, as in :class:`pagoda.sampling.sampler.Sampler`
    (penalties and min_tokens bans are excluded by :meth:`pagoda.sequence.Sequence.may_speculate`).
    """
    logits = with_bias(logits.float(), params) / params.temperature
    n, vocab = logits.shape
    if params.top_p < 1.0:
        logits = _apply_top_k_top_p(logits, [params.top_k] * n, [params.top_p] * n)
    elif 0 < params.top_k < vocab:
        # top-k alone: a k-th largest threshold instead of a full sort (differs only on exact ties)
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        threshold = probs.max(dim=-1, keepdim=True).values * params.min_p
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


@dataclass
class Verdict:
    """One request's outcome: the tokens to append (accepted drafts, then one corrected or bonus token)."""

    token_ids: list[int]
    num_accepted: int


def accept_greedy(target_argmax: torch.Tensor, draft_token_ids: torch.Tensor, num_drafts: int) -> Verdict:
    """``target_argmax``: ``[k + 1]``; ``draft_token_ids``: ``[k]``. Accept while the draft is the argmax."""
    k = num_drafts
    matches = (draft_token_ids[:k] == target_argmax[:k]).to(torch.int64)
    num_accepted = int(matches.cumprod(0).sum()) if k else 0
    return Verdict(target_argmax[:num_accepted + 1].tolist(), num_accepted)


def accept_sampled(p: torch.Tensor, draft_token_ids: torch.Tensor, q: Optional[torch.Tensor],
                   uniforms: torch.Tensor, noise: torch.Tensor) -> Verdict:
    """One request's rejection sampling.

    ``p``: ``[k + 1, vocab]`` target probabilities; ``draft_token_ids``: ``[k]``;
    ``q``: ``[k, vocab]`` draft probabilities, or None for point masses at the drafts;
    ``uniforms``: ``[k]`` draws from U[0, 1); ``noise``: ``[vocab]`` draws from Exp(1)
    for the final token (``argmax(w / E)`` picks index i with probability ``w_i / sum(w)``).
    """
    k = draft_token_ids.shape[0]
    if k:
        p_draft = p[:k].gather(1, draft_token_ids[:, None]).squeeze(1)  # [k]
        q_draft = torch.ones(k) if q is None else q.gather(1, draft_token_ids[:, None]).squeeze(1)
        # u < p / q, written without dividing (q > 0 wherever a draft was sampled)
        accepted = (uniforms[:k] * q_draft < p_draft).to(torch.int64)
        num_accepted = int(accepted.cumprod(0).sum())
    else:
        num_accepted = 0
    weights = p[num_accepted]
    if num_accepted < k:
        if q is None:
            residual = weights.clone()
            residual[draft_token_ids[num_accepted]] = 0.0
        else:
            residual = (weights - q[num_accepted]).clamp_(min=0.0)
        if float(residual.sum()) > 0:  # zero only if p == q up to rounding, where rejection is (near) impossible
            weights = residual
    final = int((weights / noise).argmax())
    return Verdict(draft_token_ids[:num_accepted].tolist() + [final], num_accepted)


class RejectionSampler:
    """Verifies each request's drafts against the target's logits at the k + 1 scored positions.

    Seeded requests draw their uniforms and noise from their own generator
    (the one the default sampler uses), so their tokens are reproducible.
    """

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, row_starts: typing.Sequence[int], requests: typing.Sequence[Sequence],
                 draft_token_ids: typing.Sequence[list[int]], draft_probs: typing.Sequence[Optional[torch.Tensor]]
                 ) -> list[Verdict]:
        """``logits``: ``[sum(k_i + 1), vocab]``, request i's rows at ``row_starts[i]``..+k_i+1.

        ``draft_probs[i]``: ``[k_i, vocab]`` or None (point masses).
        """
        verdicts = []
        argmax = None
        if any(r.sampling_params.is_greedy for r in requests):
            argmax = logits.argmax(dim=-1)  # [total rows]; one pass for the whole batch
        for i, req in enumerate(requests):
            k = len(draft_token_ids[i])
            rows = slice(row_starts[i], row_starts[i] + k + 1)
            drafts = torch.tensor(draft_token_ids[i], dtype=torch.int64)
            params = req.sampling_params
            if params.is_greedy:
                best = with_bias(logits[rows], params).argmax(dim=-1) if params.logit_bias else argmax[rows]
                verdicts.append(accept_greedy(best, drafts, k))
                continue
            generator = _generator_for(req, self.generator)
            p = target_probs(logits[rows], params)
            uniforms = torch.rand(k, generator=generator)
            noise = torch.empty(p.shape[-1]).exponential_(generator=generator)
            verdicts.append(accept_sampled(p, drafts, draft_probs[i], uniforms, noise))
        return verdicts
