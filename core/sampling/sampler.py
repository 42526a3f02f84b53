"""The ``default`` sampler: logits processing and token choice, vectorised over the batch."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Optional

import torch

from pagoda import hookimpl
from pagoda.config import ModelConfig
from pagoda.sequence import Sequence
from pagoda.step import TokenLogprobs  # {token_id: (logprob, rank)} for one position


# tokens per block of the two-level inverse-CDF draw (see draw_inverse_cdf)
CDF_BLOCK = 256


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (the first maximum of each row; a NaN counts as the maximum, as in torch).

    A float32 CPU matrix goes through numpy, whose vectorised argmax is several times torch's here: batch
    64 over the 49,152-token vocabulary, 0.28 ms against 2.1 ms, every decode step.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per request
    logprobs: Optional[list[Optional[TokenLogprobs]]] = None  # per request, when asked for


class Sampler:
    """Applies logit bias, min_tokens, penalties, temperature, top-k, top-p and min-p, then samples.

    Greedy rows take the argmax. Random rows draw by the inverse of their
    cumulative distribution: one uniform number per row, the first token whose
    running sum of probabilities passes it (one pass over the vocabulary, no
    noise per token: exponential noise over a 49,152-token vocabulary at batch
    48 took 54 ms a step on two cores, the whole draw now ~2 ms); a request with
    a ``seed`` draws its number from its own generator, so its tokens do not
    depend on what else is in the batch.

    A sampler plugin may subclass it and override its public steps, in the order they run:
    :meth:`apply_bias_and_bans`, :meth:`apply_penalties`, :meth:`process_logits` (a no-op here: the
    place for a plugin's own logits processing, such as a grammar mask), and :meth:`draw` for the rows
    that sample. A subclass that overrides any of them no longer samples the standard distribution
    (:attr:`samples_standard_distribution`), so the engine refuses speculative decoding with it.
    """

    _EXTENSION_POINTS = ("apply_bias_and_bans", "apply_penalties", "process_logits", "draw")

    def __init__(self, model_config: ModelConfig) -> None:
        self.vocab_size = model_config.vocab_size
        self.generator = torch.Generator().manual_seed(model_config.seed)
        self.logprobs_mode = model_config.logprobs_mode

    def __call__(self, logits: torch.Tensor, requests: typing.Sequence[Sequence]) -> SamplerOutput:
        # logits: [num_reqs, vocab] float32, one row per request to sample
        params = [r.sampling_params for r in requests]
        want_logprobs = any(p.logprobs is not None for p in params)
        processed_mode = want_logprobs and self.logprobs_mode.startswith("processed")
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs and self.logprobs_mode == "raw_logprobs" \
            else None
        banned = [r.banned_token_ids() for r in requests]  # the min_tokens rule, once per row
        unchanged = self._plain_argmax and all(not p.has_penalties and not p.logit_bias and not b
                                               and p.allowed_token_ids is None for p, b in zip(params, banned))
        if unchanged and all(p.is_greedy for p in params):
            token_ids = argmax_rows(logits)  # no copy of the logits: nothing changes them
            processed = logits
        else:
            # a copy only when something changes the logits in place before the random rows are taken out
            token_ids, processed = self._sample(logits if unchanged else logits.clone(), requests, banned,
                                                keep_processed=processed_mode)
        token_list = token_ids.tolist()
        logprobs = None
        if want_logprobs:
            if not processed_mode:
                values = raw_logprobs if raw_logprobs is not None else logits  # raw_logits: the logits as given
            else:  # a token the settings removed gets a finite value JSON can carry, as vLLM's server gives
                values = torch.log_softmax(processed, dim=-1) if self.logprobs_mode == "processed_logprobs" \
                    else processed
                values = values.clamp(min=REMOVED_TOKEN_LOGPROB)
            logprobs = [
                _token_logprobs(values[i], token_list[i], p.logprobs) if p.logprobs is not None else None
                for i, p in enumerate(params)
            ]
        return SamplerOutput(token_list, logprobs)

    @property
    def samples_standard_distribution(self) -> bool:
        """Whether tokens follow exactly the distribution the sampling parameters describe: true unless a
        subclass overrides one of the extension points."""
        return all(getattr(type(self), name) is getattr(Sampler, name) for name in self._EXTENSION_POINTS)

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's token and logprobs depend on that row alone: every step here is per row (log-softmax,
        argmax, softmax and the inverse-CDF draw reduce along a row; a seeded request draws from its own
        generator), so true unless a subclass overrides one of the extension points."""
        return self.samples_standard_distribution

    @property
    def _plain_argmax(self) -> bool:
        # greedy rows with nothing to apply may skip every step (and the copy of the logits)
        return type(self).process_logits is Sampler.process_logits and \
            type(self).apply_bias_and_bans is Sampler.apply_bias_and_bans

    def _sample(self, logits: torch.Tensor, requests: typing.Sequence[Sequence], banned: list[list[int]],
                keep_processed: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The rows' tokens and, with ``keep_processed``, the logits each was chosen from ``[n, vocab]``: after
        bias, bans, penalties and ``process_logits``, and for the random rows after temperature, top-k, top-p
        and min-p too (removed tokens -inf)."""
        n, vocab = logits.shape
        params = [r.sampling_params for r in requests]
        self.apply_bias_and_bans(logits, requests, banned)
        if any(p.has_penalties for p in params):
            self.apply_penalties(logits, requests)
        self.process_logits(logits, requests)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows:
            return argmax_rows(logits), logits
        # the greedy rows' argmax; the random rows' tokens are drawn below
        out = argmax_rows(logits) if len(random_rows) < n else torch.empty(n, dtype=torch.int64)
        sub_params = [params[i] for i in random_rows]
        temperatures = [p.temperature for p in sub_params]
        # extreme penalties can push logits to +inf, and softmax over an inf is NaN: the largest finite
        # value keeps those tokens on top, tied with each other
        posinf = torch.finfo(logits.dtype).max
        rows = slice(None) if len(random_rows) == n else torch.tensor(random_rows)
        if all(t == 1.0 for t in temperatures):  # the server's default: no division, one pass fewer
            # a new tensor: the logits passed in stay as they were
            sub = torch.nan_to_num(logits[rows], nan=float("-inf"), posinf=posinf)
        else:
            temperature = torch.tensor(temperatures, dtype=torch.float32)[:, None]
            sub = logits.div(temperature) if len(random_rows) == n else logits[rows].div_(temperature)
            torch.nan_to_num_(sub, nan=float("-inf"), posinf=posinf)
        top_k = [p.top_k for p in sub_params]
        top_p = [p.top_p for p in sub_params]
        if any(k for k in top_k) or any(p < 1.0 for p in top_p):
            sub = _apply_top_k_top_p(sub, top_k, top_p)
        probs = torch.softmax(sub, dim=-1)
        if any(p.min_p > 0 for p in sub_params):
            min_p = torch.tensor([p.min_p for p in sub_params], dtype=torch.float32)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            below = probs < threshold
            probs.masked_fill_(below, 0.0)
            if keep_processed:
                sub = sub.masked_fill(below, float("-inf"))
        out[rows] = self.draw(probs, [requests[i] for i in random_rows])
        if not keep_processed:
            return out, None
        processed = logits.clone()  # the caller's logits stay as they were
        processed[rows] = sub
        return out, processed

    def process_logits(self, logits: torch.Tensor, requests: typing.Sequence[Sequence]) -> None:
        """Change ``logits [n, vocab]`` in place, row ``i`` for ``requests[i]``, after bias, bans and
        penalties and before temperature and the filters; a row set to -inf everywhere but one token takes
        that token. Nothing here; a subclass's own processing goes here."""

    def draw(self, probs: torch.Tensor, requests: typing.Sequence[Sequence]) -> torch.Tensor:
        """One token id per row of ``probs [n, vocab]`` (filtered, normalised), drawn with probability
        ``probs[i, t]``; a request with a seed uses its own generator, the others share the sampler's."""
        return draw_inverse_cdf(probs, self._uniforms(requests))

    def _uniforms(self, requests: typing.Sequence[Sequence]) -> torch.Tensor:
        """One float64 number in [0, 1) per request: from its own generator when it has a seed, else (in one
        call) from the sampler's."""
        u = torch.rand(len(requests), dtype=torch.float64, generator=self.generator)
        for j, request in enumerate(requests):
            if request.seed is not None:
                u[j] = torch.rand(1, dtype=torch.float64, generator=_generator_for(request, self.generator))
        return u

    def apply_bias_and_bans(self, logits: torch.Tensor, requests: typing.Sequence[Sequence],
                            banned: list[list[int]]) -> None:
        """Add each request's ``logit_bias``; set its banned tokens (``Sequence.banned_token_ids``, given as
        ``banned[i]``) and, with ``allowed_token_ids``, every other token to -inf."""
        for i, r in enumerate(requests):
            p = r.sampling_params
            if p.allowed_token_ids is not None:
                keep = torch.full((logits.shape[1],), float("-inf"))
                keep[torch.tensor([t for t in p.allowed_token_ids if t < self.vocab_size], dtype=torch.int64)] = 0.0
                logits[i].add_(keep)
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if t < self.vocab_size], dtype=torch.int64)
                vals = torch.tensor([p.logit_bias[t] for t in p.logit_bias if t < self.vocab_size])
                logits[i].index_add_(0, ids, vals)
            if banned[i]:
                logits[i, torch.tensor(banned[i])] = float("-inf")

    def apply_penalties(self, logits: torch.Tensor, requests: typing.Sequence[Sequence]) -> None:
        """Repetition (prompt and output tokens), frequency and presence penalties, in place; called only
        when some request has one."""
        n, vocab = logits.shape
        out_counts = torch.zeros(n, vocab, dtype=torch.float32)
        seen_prompt = torch.zeros(n, vocab, dtype=torch.bool)
        for i, r in enumerate(requests):
            if r.output_token_ids:
                ids = torch.tensor(r.output_token_ids, dtype=torch.int64)
                out_counts[i].index_add_(0, ids, torch.ones(len(ids)))
            if r.sampling_params.repetition_penalty != 1.0:
                seen_prompt[i, torch.tensor(r.prompt_token_ids, dtype=torch.int64)] = True
        params = [r.sampling_params for r in requests]
        rep = torch.tensor([p.repetition_penalty for p in params])[:, None]
        seen = seen_prompt | (out_counts > 0)
        # repetition penalty (prompt and output): shrink positive logits, grow negative ones
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalised, logits))
        freq = torch.tensor([p.frequency_penalty for p in params])[:, None]
        presence = torch.tensor([p.presence_penalty for p in params])[:, None]
        logits.sub_(freq * out_counts + presence * (out_counts > 0).float())


# what processed logprobs give a token the request's settings removed (-inf has no JSON form)
REMOVED_TOKEN_LOGPROB = -9999.0


def draw_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs [n, vocab]`` (non-negative, not all zero), the first token whose running sum passes
    ``u[i]`` (in [0, 1)) times the row's total: token ``t`` with probability ``probs[i, t] / total``. A token of
    probability 0 is never drawn (its running sum equals its predecessor's, which passed first).

    Two levels, so no running sum spans the vocabulary: the running sum of each row's block sums
    (``CDF_BLOCK`` tokens a block) finds the block, then the running sum within that block the token. Over
    the default model's 49,152 tokens on one core (Zen 5, best of 120 calls): 0.05 ms against 0.15 ms for one
    running sum over each whole row at 4 rows, 0.07 against 0.46 ms at 12 (a long row's cumsum is a serial loop).
    """
    n, vocab = probs.shape
    if vocab < 2 * CDF_BLOCK:
        return _draw_one_level(probs, u)
    num_blocks = -(-vocab // CDF_BLOCK)
    padded = probs if vocab == num_blocks * CDF_BLOCK else \
        torch.nn.functional.pad(probs, (0, num_blocks * CDF_BLOCK - vocab))
    blocks = padded.view(n, num_blocks, CDF_BLOCK)  # [n, num_blocks, CDF_BLOCK]
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)  # [n, num_blocks]
    target = (u.to(torch.float64)[:, None] * block_cdf[:, -1:].to(torch.float64)).to(block_cdf.dtype)  # [n, 1]
    # the block whose running sum first passes the target; rounding can put the target on the total: the last
    # block of non-zero mass then
    block = torch.minimum(torch.searchsorted(block_cdf, target, right=True).flatten(), argmax_rows(block_cdf))
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)[:, None]).flatten(), 0.0)
    inner = blocks[torch.arange(n), block].cumsum(dim=-1) + before[:, None]  # [n, CDF_BLOCK]
    # the two levels round apart: a target past the block's own running total takes its last token of mass
    picked = torch.minimum(torch.searchsorted(inner, target, right=True).flatten(), argmax_rows(inner))
    return block * CDF_BLOCK + picked


def _draw_one_level(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`draw_inverse_cdf` with one running sum over each whole row (for small vocabularies)."""
    cdf = probs.cumsum(dim=-1)
    target = (u.to(torch.float64)[:, None] * cdf[:, -1:].to(torch.float64)).to(cdf.dtype)
    picked = torch.searchsorted(cdf, target, right=True).flatten()
    # rounding can put the target on the row's total: the last token of non-zero probability then
    last = argmax_rows(cdf)
    return torch.minimum(picked, last)


def _generator_for(request: Sequence, default: torch.Generator) -> torch.Generator:
    if request.seed is None:
        return default
    if request.sampler_state is None:
        request.sampler_state = torch.Generator().manual_seed(request.seed)
    return request.sampler_state


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """``logits [n, vocab]`` with the tokens outside each row's top-k, then outside its nucleus (the most
    likely tokens of the top-k's renormalised distribution whose mass reaches top_p, the one crossing it
    included), set to -inf; a new tensor.

    Both cut at a value: top-k keeps every token whose logit is at least the row's k-th largest, the nucleus
    every token at least as likely as its least likely member, so tied tokens stay or go together and a row's
    set depends on its own logits and settings alone, never on a sort's order among ties nor on the other rows.
    Rows of one k are filtered together; a top-k reads only the k largest logits (``topk``) instead of
    sorting the vocabulary: top_k=20 over Qwen3's 151,936 tokens is some 0.1 ms a row where the sort took
    about 3 ms. A nucleus without a top-k (or a large one) looks among the NUCLEUS_CANDIDATES most likely
    tokens first and sorts the row only when they hold less than top_p."""
    n, vocab = logits.shape
    groups: dict[int, list[int]] = {}
    for i, (k, p) in enumerate(zip(top_k, top_p)):
        k = k if 0 < k < vocab else vocab
        if k < vocab or p < 1.0:
            groups.setdefault(k, []).append(i)
    keep_from = torch.full((n, 1), float("-inf"), dtype=logits.dtype)
    for k, rows in groups.items():
        index = torch.tensor(rows)
        sub = logits[index]
        p = torch.tensor([top_p[i] for i in rows], dtype=torch.float32)[:, None]
        if bool((p < 1.0).any()):
            keep_from[index] = _nucleus_cut(sub, k, p)
        else:
            keep_from[index] = sub.topk(k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < keep_from, float("-inf"))


# a nucleus without a small top-k is looked for among this many of a row's most likely tokens first
NUCLEUS_CANDIDATES = 1024


def _nucleus_cut(sub: torch.Tensor, k: int, p: torch.Tensor) -> torch.Tensor:
    """The smallest logit each row of ``sub [r, vocab]`` keeps under top-k ``k`` and then top-p ``p [r, 1]``
    (1 for rows without a nucleus): ``[r, 1]``."""
    vocab = sub.shape[-1]
    if k <= NUCLEUS_CANDIDATES:
        values = sub.topk(k, dim=-1).values  # [r, k], largest first
        return values.gather(1, _nucleus_size(torch.softmax(values, dim=-1), p) - 1)
    kth = sub.topk(k, dim=-1).values[:, -1:] if k < vocab else None
    if kth is not None:
        sub = sub.masked_fill(sub < kth, float("-inf"))
    # the row's whole distribution (softmax reduces each row alone, whatever the number of rows), its most
    # likely candidates first
    probs = torch.softmax(sub, dim=-1)
    top_probs, top_ids = probs.topk(min(NUCLEUS_CANDIDATES, vocab), dim=-1)
    cut = torch.empty(len(sub), 1, dtype=sub.dtype)
    inside = top_probs.sum(dim=-1) >= p.flatten()
    if bool(inside.any()):
        size = _nucleus_size(top_probs[inside], p[inside])
        cut[inside] = sub[inside].gather(1, top_ids[inside].gather(1, size - 1))
    if not bool(inside.all()):  # the candidates hold less than top_p: the whole row, sorted
        outside = ~inside
        values, ids = probs[outside].sort(dim=-1, descending=True)
        size = _nucleus_size(values, p[outside])
        cut[outside] = sub[outside].gather(1, ids.gather(1, size - 1))
    # a top_p that rounding puts past the row's whole mass would reach the tokens the top-k left out
    return cut if kth is None else torch.maximum(cut, kth)


def _nucleus_size(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """How many of each row's tokens (``probs [r, m]``, largest first) the nucleus takes: those whose mass
    before them is below ``p [r, 1]``, at least one: ``[r, 1]``."""
    mass_before = probs.cumsum(dim=-1) - probs
    return (mass_before < p).sum(dim=-1, keepdim=True).clamp(min=1)


def _token_logprobs(row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    # row: [vocab] log-probabilities of the raw model distribution
    chosen = float(row[token_id])
    rank = int((row > chosen).sum()) + 1
    result: TokenLogprobs = {token_id: (chosen, rank)}
    if num_top:
        values, ids = row.topk(num_top)
        for r, (tid, lp) in enumerate(zip(ids.tolist(), values.tolist()), start=1):
            result.setdefault(tid, (lp, r))
    return result


def prompt_logprobs_for(logprobs: torch.Tensor, next_token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """Log-probabilities of each actual next prompt token. ``logprobs``: ``[n, vocab]``."""
    return [_token_logprobs(logprobs[i], t, num_top) for i, t in enumerate(next_token_ids)]


@hookimpl
def pagoda_samplers():
    return {"default": Sampler}
