"""Sampler checks: what every sampler must get right, whatever its method of drawing."""

from __future__ import annotations

import math
from typing import Optional

import torch

from pagoda.config import ModelConfig
from pagoda.interfaces import SamplerFactory
from pagoda.sampling_params import SamplingParams
from pagoda.sequence import Sequence
from pagoda.testing.contract import ContractError, Where

VOCAB = 96
EOS = 2


def check_sampler(factory: SamplerFactory, draws: int = 2000, seed: int = 0) -> None:
    """Check a ``pagoda_samplers`` factory (``factory(model_config)`` -> ``sampler(logits, sequences)``):

    - one token id in the vocabulary per row, with rows of different settings mixed in one batch;
    - ``temperature=0`` takes the argmax, and so does ``top_k=1`` at any temperature;
    - a sequence's ``banned_token_ids()`` (EOS and stop ids before ``min_tokens``) is never drawn, not even
      when it is the argmax;
    - at ``temperature`` T, over ``draws`` draws, token frequencies follow ``softmax(logits / T)`` (total
      variation distance below a bound that a sampler ignoring T, top_p or min_p exceeds);
    - a sequence with a seed draws the same tokens alone as in a batch with others;
    - ``logprobs=k`` gives the drawn token's log-probability under the model's distribution, its rank, and
      the k most likely tokens;
    - greedy rows whose histories repeat n-grams (so history-dependent code runs) draw the same token alone as
      in a batch, in either order (a ban of one row never reaches another), with the model's logprobs.

    Raises ContractError.
    """
    where = Where(getattr(factory, "__name__", repr(factory)), seed)
    sampler = factory(_model_config())
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    logits[2, EOS] = 50.0  # the banned token is this row's argmax
    rows = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=1),
            SamplingParams(temperature=0.0, min_tokens=3), SamplingParams(temperature=0.8, logprobs=3),
            SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=1.0, top_p=0.9)]
    seqs = [_sequence(f"row{i}", p) for i, p in enumerate(rows)]
    out = sampler(logits.clone(), seqs)
    ids = _token_ids(out, len(seqs), where.at("1 (6 rows of mixed settings)", "batch"))
    argmax = logits.argmax(dim=-1).tolist()
    for i in (0, 1, 4):
        if ids[i] != argmax[i]:
            raise where.at("1 (6 rows of mixed settings)", "batch").fail(
                "the sampler's __call__()", f"row {i} ({_describe(rows[i])}) drew token {ids[i]}, not the argmax "
                f"{argmax[i]}", "temperature 0 (or top_k=1) draws the most likely token",
                "the sampler's draw() or its temperature / top-k filter")
    banned = seqs[2].banned_token_ids()
    if EOS not in banned:
        raise ContractError(f"{where.describe()}: test setup: EOS should be banned before min_tokens, got {banned}")
    second = int(logits[2].masked_fill(torch.tensor([t in banned for t in range(VOCAB)]), float("-inf")).argmax())
    if ids[2] != second:
        raise where.at("1 (6 rows of mixed settings)", "batch").fail(
            "the sampler's __call__()", f"row 2 (min_tokens=3, EOS banned) drew {ids[2]}, not {second}, the most "
            "likely token that is not banned", "a sequence's banned_token_ids() are never drawn",
            "the sampler's apply_bias_and_bans()")
    _check_logprobs(out, logits, ids, rows, where)
    for params in (SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, top_p=0.6),
                   SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=1.0, top_k=5)):
        _check_distribution(sampler, params, draws, gen, where)
    _check_seeds(sampler, gen, where)
    _check_histories(sampler, gen, where)


# token histories (prompt + output) with repeated n-grams, so that history-dependent code (n-gram bans,
# penalties) runs; each row's argmax is a token another row's history would ban (it completes a repeated n-gram
# there), so a ban that leaks across rows changes a row's token
# (history, its argmax, the token completing its own repeated n-gram or None): that token is likely too, so a ban
# of it changes the row's distribution measurably
HISTORIES = [
    ([10, 11, 12, 30, 10, 11], 51, 12),          # tail (10, 11) was followed by 12 before
    ([40, 41, 42, 40, 41, 42, 40, 41], 12, 42),  # a repeated 3-gram, twice; its tail (40, 41) was followed by 42
    ([50, 51, 52, 53, 54, 55, 56], 42, None),    # nothing repeated
    ([12, 50, 51, 12, 50], 57, 51),              # tail (12, 50) was followed by 51
]


def _check_histories(sampler, gen: torch.Generator, where: Where) -> None:
    """Greedy rows whose histories repeat n-grams: each row draws the same token alone as in the batch (in either
    order), and its logprobs are the model's (raw) distribution's."""
    where = where.at("4 (greedy rows whose histories repeat n-grams)", "batch")
    logits = torch.randn(len(HISTORIES), VOCAB, generator=gen)
    for row, (_, favourite, repeat) in enumerate(HISTORIES):
        logits[row, favourite] = 8.0
        if repeat is not None:
            logits[row, repeat] = 7.0
    rows = [SamplingParams(temperature=0.0, logprobs=2) for _ in HISTORIES]

    def run(order: list[int]) -> tuple[list[int], object]:
        seqs = [_sequence(f"h{i}", rows[i], history=HISTORIES[i][0]) for i in order]
        try:
            out = sampler(logits[order].clone(), seqs)
        except Exception as exc:
            raise where.fail("the sampler's __call__()", f"it raised {type(exc).__name__}: {exc} on rows "
                             f"{order} (histories {[HISTORIES[i][0] for i in order]})",
                             "a sampler handles any token history (repeated n-grams included)",
                             "the sampler's history-dependent code (process_logits(), apply_penalties())") from exc
        return _token_ids(out, len(order), where), out

    batch, out = run(list(range(len(HISTORIES))))
    _check_logprobs(out, logits, batch, rows, where)
    backwards = run(list(reversed(range(len(HISTORIES)))))[0][::-1]
    for i in range(len(HISTORIES)):
        alone = run([i])[0][0]
        if alone != batch[i] or alone != backwards[i]:
            raise where.fail(
                "the sampler's __call__()", f"row {i} (history {HISTORIES[i][0]}) drew {alone} alone, {batch[i]} in "
                f"the batch of {len(HISTORIES)} and {backwards[i]} in the batch reversed",
                "a greedy row's token depends on its own history only, never on the other rows of its batch",
                "the sampler's process_logits() (bans or penalties of one row applied to another: index logits by "
                "the row of each request)")


def _model_config() -> ModelConfig:
    return ModelConfig(model="", tokenizer="", served_model_name="conformance", hf_config={},
                       architecture="conformance", dtype=torch.float32, max_model_len=256, seed=0,
                       load_format="dummy", quantization=None, quant_config=None, chat_template=None,
                       vocab_size=VOCAB, hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=64)


def _sequence(request_id: str, params: SamplingParams, seed: Optional[int] = None,
              history: Optional[list[int]] = None) -> Sequence:
    """A sequence whose tokens so far are ``history`` (its first three the prompt, the rest its output)."""
    history = history or [5, 6, 7]
    seq = Sequence(request_id, history[:3], params, eos_token_id=EOS, seed=seed)
    seq.all_token_ids = list(history)
    seq.output_token_ids = list(history[3:])
    return seq


def _describe(params: SamplingParams) -> str:
    fields = ("temperature", "top_k", "top_p", "min_p", "min_tokens", "logprobs")
    defaults = SamplingParams()
    return ", ".join(f"{f}={getattr(params, f)}" for f in fields
                     if f == "temperature" or getattr(params, f) != getattr(defaults, f))


def _token_ids(out, n: int, where: Where) -> list[int]:
    ids = list(getattr(out, "token_ids", None) or [])
    if len(ids) != n:
        raise where.fail("the sampler's __call__()", f"the output has {len(ids)} token ids for {n} rows",
                         "one token id per row", "the sampler's __call__() or draw()")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or not 0 <= t < VOCAB:
            raise where.fail("the sampler's __call__()", f"row {i}: {t!r} is not a token id in [0, {VOCAB})",
                             "token ids are Python ints within the vocabulary", "the sampler's draw()")
    return ids


def _check_logprobs(out, logits: torch.Tensor, ids: list[int], rows: list[SamplingParams], where: Where) -> None:
    if where.step is None:
        where = where.at("1 (6 rows of mixed settings)", "batch")
    rule = "logprobs=k gives the drawn token's log-probability and rank under the model's distribution, and the k " \
           "most likely tokens"
    raw = torch.log_softmax(logits, dim=-1)
    logprobs = getattr(out, "logprobs", None)
    for i, params in enumerate(rows):
        if params.logprobs is None:
            continue
        entry = logprobs[i] if logprobs is not None and i < len(logprobs) else None
        if not entry or ids[i] not in entry:
            raise where.fail("the sampler's __call__()", f"row {i} asked for logprobs={params.logprobs} but has no "
                             f"entry for its token {ids[i]}", rule, "the sampler's logprobs")
        value, rank = entry[ids[i]]
        want_rank = int((raw[i] > raw[i, ids[i]]).sum()) + 1
        if not math.isclose(value, float(raw[i, ids[i]]), abs_tol=1e-4) or rank != want_rank:
            raise where.fail("the sampler's __call__()", f"row {i}: token {ids[i]} has logprob {value:.5f} rank "
                             f"{rank}; the model's distribution gives {float(raw[i, ids[i]]):.5f} rank {want_rank}",
                             rule, "the sampler's __call__() (logprobs taken from logits it changed, e.g. "
                             "before calling super().__call__(), rather than from the model's raw logits)")
        top = raw[i].topk(params.logprobs).indices.tolist() if params.logprobs else []
        missing = [t for t in top if t not in entry]
        if missing:
            raise where.fail("the sampler's __call__()", f"row {i} asked for the {params.logprobs} most likely "
                             f"tokens; {missing} are missing", rule, "the sampler's logprobs")


def _expected(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution ``p`` asks for: temperature, then top-k, top-p (the token crossing it kept), min-p."""
    probs = torch.softmax(logits / p.temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, t in enumerate(order.tolist()):
        if (p.top_k and rank >= p.top_k) or mass >= p.top_p:
            break
        keep[t] = True
        mass += float(probs[t])
    keep &= probs >= probs.max() * p.min_p
    probs = probs * keep
    return probs / probs.sum()


def _check_distribution(sampler, params: SamplingParams, draws: int, gen: torch.Generator, where: Where) -> None:
    where = where.at(f"2 ({_describe(params)})", "distribution check")
    # a few likely tokens and a long tail, so temperature and the filters all change the distribution
    logits = torch.full((VOCAB,), -2.0)
    logits[:8] = torch.linspace(2.0, 0.0, 8)
    logits += torch.rand(VOCAB, generator=gen) * 0.1
    counts = torch.zeros(VOCAB)
    batch = 250
    for _ in range(max(1, draws // batch)):
        seqs = [_sequence(f"d{i}", params) for i in range(batch)]
        out = sampler(logits.expand(batch, VOCAB).clone(), seqs)
        for t in _token_ids(out, batch, where):
            counts[t] += 1
    observed = counts / counts.sum()
    expected = _expected(logits, params)
    tv = 0.5 * float((observed - expected).abs().sum())
    outside = int(counts[expected == 0].sum())
    # an exact sampler's expected TV distance is about sqrt(2 / pi) / 2 * sum_i sqrt(p_i (1 - p_i) / draws)
    n = float(counts.sum())
    typical = (2 / math.pi) ** 0.5 / 2 * float((expected * (1 - expected) / n).sqrt().sum())
    bound = 0.02 + 2.0 * typical
    if outside or tv > bound:
        raise where.fail(
            "the sampler's __call__()", f"with {_describe(params)}, {int(counts.sum())} draws are {tv:.3f} (total "
            f"variation) from the distribution asked for (bound {bound:.3f}); {outside} draws fell outside it; most "
            f"drawn {counts.topk(4).indices.tolist()}, expected {expected.topk(4).indices.tolist()}",
            "draws follow softmax(logits / temperature) after the top-k, top-p and min-p filters",
            "the sampler's draw() or process_logits(), or its temperature and filters")


def _check_seeds(sampler, gen: torch.Generator, where: Where) -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.randn(4, VOCAB, generator=gen)
    alone_seq = _sequence("alone", params, seed=1234)
    alone = [sampler(logits[:1].clone(), [alone_seq]).token_ids[0] for _ in range(5)]
    together_seq = _sequence("together", params, seed=1234)
    others = [_sequence(f"other{i}", SamplingParams(temperature=1.0)) for i in range(3)]
    together = [sampler(logits.clone(), [together_seq] + others).token_ids[0] for _ in range(5)]
    if alone != together:
        raise where.at("3 (seeded rows)", "batch").fail(
            "the sampler's __call__()", f"a sequence with seed 1234 drew {alone} alone but {together} in a batch of 4",
            "a seeded sequence's tokens must not depend on its batch", "the sampler's draw() (its per-row generators)")
