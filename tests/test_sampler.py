"""The default sampler fed hand-made logits: support restrictions, distributions, seeds, penalties, bias.

Statistical checks draw many samples in one call (one row per draw) from a sampler whose own
generator is seeded, so each check is deterministic and still compares frequencies against the
distribution the parameters specify.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.config import ModelConfig
from pagoda.sampling.sampler import NUCLEUS_CANDIDATES, Sampler, _apply_top_k_top_p
from pagoda.sampling_params import SamplingParams
from pagoda.sequence import Sequence

VOCAB = 6
EOS = 5
# probabilities 0.5, 0.2, 0.15, 0.1, 0.05 (token 5 gets ~0)
PROBS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 1e-9])
LOGITS = PROBS.log()
NUM_DRAWS = 20_000


def model_config(vocab_size: int = VOCAB, seed: int = 0) -> ModelConfig:
    return ModelConfig(
        model="hand-made", tokenizer="hand-made", served_model_name="hand-made", hf_config={},
        architecture="LlamaForCausalLM", dtype=torch.float32, max_model_len=64, seed=seed,
        load_format="dummy", quantization=None, quant_config=None, chat_template=None,
        vocab_size=vocab_size, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
    )


def make_request(params: SamplingParams, prompt=(1, 2, 3), output=(), seed=None, rid="r") -> Sequence:
    req = Sequence(rid, list(prompt), params, eos_token_id=EOS, seed=seed)
    for t in output:
        req.append_output_tokens([t], 1 << 20)
    return req


def draw(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = NUM_DRAWS, seed: int = 0) -> torch.Tensor:
    """Token counts over ``n`` independent draws from one row of logits: ``[vocab]``."""
    sampler = Sampler(model_config(logits.shape[-1], seed))
    requests = [make_request(params, rid=str(i)) for i in range(n)]
    tokens = sampler(logits.expand(n, -1).clone(), requests).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float()


def assert_frequencies_match(counts: torch.Tensor, expected_probs: torch.Tensor) -> None:
    """Every token's frequency within 5 standard deviations of its expected probability."""
    n = counts.sum()
    freq = counts / n
    sigma = (expected_probs * (1 - expected_probs) / n).sqrt()
    assert torch.all((freq - expected_probs).abs() <= 5 * sigma + 1e-6), (freq, expected_probs)


# ---- support restrictions ----------------------------------------------------------------------


def test_greedy_always_takes_the_argmax():
    counts = draw(SamplingParams(temperature=0.0), n=50)
    assert counts[0] == 50


def test_temperature_one_samples_the_model_distribution():
    assert_frequencies_match(draw(SamplingParams(temperature=1.0)), PROBS)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_sharpens_or_flattens_the_distribution(temperature):
    expected = torch.softmax(LOGITS / temperature, dim=-1)
    assert_frequencies_match(draw(SamplingParams(temperature=temperature)), expected)


def test_top_k_keeps_exactly_the_k_most_likely_tokens():
    counts = draw(SamplingParams(temperature=1.0, top_k=3))
    assert counts[3:].sum() == 0
    assert_frequencies_match(counts, torch.cat([PROBS[:3] / PROBS[:3].sum(), torch.zeros(3)]))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # cumulative 0.5, 0.7, 0.85: p=0.75 needs the first three tokens
    counts = draw(SamplingParams(temperature=1.0, top_p=0.75))
    assert counts[3:].sum() == 0
    assert_frequencies_match(counts, torch.cat([PROBS[:3] / PROBS[:3].sum(), torch.zeros(3)]))


def test_top_p_below_the_top_probability_is_greedy():
    counts = draw(SamplingParams(temperature=1.0, top_p=0.3), n=2000)
    assert counts[0] == 2000


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    # threshold 0.25 * 0.5 = 0.125: tokens 0, 1, 2 stay
    counts = draw(SamplingParams(temperature=1.0, min_p=0.25))
    assert counts[3:].sum() == 0
    assert_frequencies_match(counts, torch.cat([PROBS[:3] / PROBS[:3].sum(), torch.zeros(3)]))


def test_top_k_and_top_p_together_keep_the_intersection():
    # top_k=4 keeps 0..3 (renormalised 0.526, 0.211, 0.158, 0.105); top_p=0.6 then keeps 0 and 1
    counts = draw(SamplingParams(temperature=1.0, top_k=4, top_p=0.6))
    assert counts[2:].sum() == 0
    assert_frequencies_match(counts, torch.cat([PROBS[:2] / PROBS[:2].sum(), torch.zeros(4)]))


def test_tied_tokens_stay_or_go_together_under_top_k_and_top_p():
    # tokens 1 and 2 tie: a top-k of 2 keeps both with token 0 (every token at least the 2nd largest), and so
    # does a nucleus whose crossing token is one of them; no sort order picks one of a tie
    tied = torch.tensor([0.4, 0.2, 0.2, 0.1, 0.05, 0.05]).log()
    keep = _apply_top_k_top_p(tied.expand(3, -1).clone(), [2, 0, 0], [1.0, 0.5, 0.95])
    assert torch.isfinite(keep).tolist() == [[True, True, True, False, False, False],
                                             [True, True, True, False, False, False],
                                             [True, True, True, True, True, True]]


def test_a_rows_filter_depends_on_its_own_logits_and_settings_only():
    # every path: small top-k, top-k with top-p, a top-k past the nucleus candidates, a nucleus found among the
    # candidates and one that needs the whole row (a flat distribution), and rows with neither
    g = torch.Generator().manual_seed(0)
    vocab = 3 * NUCLEUS_CANDIDATES
    logits = torch.cat([torch.randn(4, vocab, generator=g) * 8, torch.randn(4, vocab, generator=g) * 0.1])
    settings = [(5, 1.0), (20, 0.9), (NUCLEUS_CANDIDATES + 7, 0.8), (0, 0.9), (0, 0.5), (5, 0.3), (0, 1.0), (0, 0.99)]
    together = _apply_top_k_top_p(logits, [k for k, _ in settings], [p for _, p in settings])
    for i, (k, p) in enumerate(settings):
        alone = _apply_top_k_top_p(logits[i:i + 1], [k], [p])
        assert torch.equal(alone, together[i:i + 1]), (k, p)
        probs = torch.softmax(logits[i], dim=-1)
        values, order = probs.sort(descending=True)
        ranks = torch.arange(vocab)
        kept = ranks < (k if k else vocab)
        renorm = torch.where(kept, values, 0.0) / torch.where(kept, values, 0.0).sum()
        kept &= (renorm.cumsum(0) - renorm) < p  # the reference: the sorted prefix, the crossing token included
        assert torch.equal(torch.isfinite(together[i])[order], kept), (k, p)
    assert torch.isfinite(together[6]).all()


def test_restrictions_apply_after_temperature():
    # at temperature 2 the distribution flattens; top_k=2 still keeps only the two best tokens
    counts = draw(SamplingParams(temperature=2.0, top_k=2))
    assert counts[2:].sum() == 0
    flat = torch.softmax(LOGITS[:2] / 2.0, dim=-1)
    assert_frequencies_match(counts, torch.cat([flat, torch.zeros(4)]))


def test_each_row_uses_its_own_parameters_in_a_mixed_batch():
    sampler = Sampler(model_config())
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, min_p=0.9)]
    n = 500
    requests = [make_request(params[i % 4], rid=str(i)) for i in range(4 * n)]
    tokens = torch.tensor(sampler(LOGITS.expand(4 * n, -1).clone(), requests).token_ids).view(n, 4)
    assert torch.all(tokens[:, 0] == 0) and torch.all(tokens[:, 1] == 0) and torch.all(tokens[:, 3] == 0)
    assert set(tokens[:, 2].tolist()) == {0, 1}


# ---- seeds ---------------------------------------------------------------------------------------


def _steps(sampler: Sampler, batch_at_step, steps: int = 12) -> list[int]:
    """Sample ``steps`` times; ``batch_at_step(i)`` gives (requests, row of the tracked request)."""
    out = []
    gen = torch.Generator().manual_seed(99)
    for i in range(steps):
        requests, row = batch_at_step(i)
        logits = torch.randn(len(requests), 50, generator=gen)
        logits[row] = torch.linspace(0, 3, 50)  # the tracked request sees the same logits every run
        tokens = sampler(logits, requests).token_ids
        requests[row].append_output_tokens([tokens[row]], 1 << 20)
        out.append(tokens[row])
    return out


def test_a_seeded_request_reproduces_exactly_in_different_batches():
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    alone_req = make_request(params, seed=7, rid="tracked")
    alone = _steps(Sampler(model_config(50, seed=0)), lambda i: ([alone_req], 0))

    tracked = make_request(params, seed=7, rid="tracked")
    others = [make_request(SamplingParams(temperature=1.0), rid=f"o{j}") for j in range(3)]
    others.append(make_request(SamplingParams(temperature=0.9, seed=8), seed=8, rid="other-seeded"))
    others.append(make_request(SamplingParams(temperature=0.0), rid="greedy"))

    def crowded(i):
        # a different batch every step, with the tracked request at a different row
        batch = others[: i % 5 + 1]
        row = i % (len(batch) + 1)
        return batch[:row] + [tracked] + batch[row:], row

    # another sampler whose own seed differs: the tracked request must not depend on it
    assert _steps(Sampler(model_config(50, seed=123)), crowded) == alone
    assert len(set(alone)) > 3  # it really sampled


def test_different_seeds_give_different_samples_and_unseeded_rows_follow_the_engine_seed():
    a = _steps(Sampler(model_config(50)), lambda i, r=make_request(SamplingParams(seed=1), seed=1): ([r], 0))
    b = _steps(Sampler(model_config(50)), lambda i, r=make_request(SamplingParams(seed=2), seed=2): ([r], 0))
    assert a != b
    c = _steps(Sampler(model_config(50, seed=5)), lambda i, r=make_request(SamplingParams()): ([r], 0))
    d = _steps(Sampler(model_config(50, seed=5)), lambda i, r=make_request(SamplingParams()): ([r], 0))
    assert c == d


# ---- penalties, bias, min_tokens ----------------------------------------------------------------


def greedy_choice(logits: list[float], **kwargs) -> int:
    output = kwargs.pop("output", ())
    prompt = kwargs.pop("prompt", (4,))
    params = SamplingParams(temperature=0.0, **kwargs)
    sampler = Sampler(model_config(len(logits)))
    return sampler(torch.tensor([logits]), [make_request(params, prompt=prompt, output=output)]).token_ids[0]


def test_frequency_penalty_grows_with_each_occurrence():
    logits = [2.0, 1.5, 1.0, 0.0, 0.0, 0.0]
    # 2.0 - 0.3 * count against 1.5
    assert greedy_choice(logits, frequency_penalty=0.3, output=[0]) == 0
    assert greedy_choice(logits, frequency_penalty=0.3, output=[0, 0]) == 1


def test_presence_penalty_counts_a_token_once():
    logits = [2.0, 1.5, 1.0, 0.0, 0.0, 0.0]
    assert greedy_choice(logits, presence_penalty=0.4, output=[0, 0, 0]) == 0
    assert greedy_choice(logits, presence_penalty=0.6, output=[0]) == 1


def test_frequency_and_presence_penalties_ignore_the_prompt():
    logits = [2.0, 1.5, 1.0, 0.0, 0.0, 0.0]
    assert greedy_choice(logits, presence_penalty=2.0, frequency_penalty=2.0, prompt=[0, 0, 0]) == 0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # token 0 in the prompt: 2.0 / 1.2 = 1.67 > 1.5, 2.0 / 1.5 = 1.33 < 1.5
    assert greedy_choice([2.0, 1.5, 0, 0, 0, 0], repetition_penalty=1.2, prompt=[0]) == 0
    assert greedy_choice([2.0, 1.5, 0, 0, 0, 0], repetition_penalty=1.5, prompt=[0]) == 1
    # token 0 in the output: -1.0 * 1.5 = -1.5 < -1.2
    assert greedy_choice([-1.0, -1.2, -5, -5, -5, -5], repetition_penalty=1.5, output=[0]) == 1
    # below 1 it rewards repetition
    assert greedy_choice([1.0, 1.5, 0, 0, 0, 0], repetition_penalty=0.5, prompt=[0]) == 0


def test_penalties_shape_the_sampled_distribution_too():
    params = SamplingParams(temperature=1.0, frequency_penalty=1.0)
    sampler = Sampler(model_config())
    n = NUM_DRAWS
    requests = [make_request(params, output=[0, 0], rid=str(i)) for i in range(n)]
    counts = torch.bincount(torch.tensor(sampler(LOGITS.expand(n, -1).clone(), requests).token_ids),
                            minlength=VOCAB).float()
    expected = torch.softmax(LOGITS - torch.tensor([2.0, 0, 0, 0, 0, 0]), dim=-1)
    assert_frequencies_match(counts, expected)


def test_logit_bias_can_force_or_forbid_a_token():
    logits = [2.0, 1.5, 1.0, 0.0, 0.0, 0.0]
    assert greedy_choice(logits, logit_bias={3: 100.0}) == 3
    assert greedy_choice(logits, logit_bias={0: -100.0}) == 1
    counts = draw(SamplingParams(temperature=1.0, logit_bias={4: 100.0}), n=500)
    assert counts[4] == 500


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(VOCAB)
    logits[EOS], logits[2] = 10.0, 9.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    sampler = Sampler(model_config())
    early = make_request(params, output=[0])
    assert sampler(logits[None].clone(), [early]).token_ids == [0]  # EOS and 2 are banned: next best
    done = make_request(params, output=[0, 1])
    assert sampler(logits[None].clone(), [done]).token_ids == [EOS]
    ignoring = make_request(params.clone(ignore_eos=True), output=[0])
    assert sampler(logits[None].clone(), [ignoring]).token_ids == [EOS]  # with ignore_eos, EOS is an ordinary token


# ---- logprobs ------------------------------------------------------------------------------------


def test_logprobs_describe_the_raw_model_distribution():
    sampler = Sampler(model_config())
    params = SamplingParams(temperature=0.5, top_k=2, logprobs=3, seed=0)
    out = sampler(LOGITS[None].clone(), [make_request(params, seed=0)])
    entry = out.logprobs[0]
    token = out.token_ids[0]
    raw = torch.log_softmax(LOGITS, dim=-1)
    assert token in entry
    for tid, (lp, rank) in entry.items():
        assert math.isclose(lp, float(raw[tid]), abs_tol=1e-6)
        assert rank == int((raw > raw[tid]).sum()) + 1
    assert {tid for tid, (_, rank) in entry.items() if rank <= 3} == {0, 1, 2}


def test_sampler_does_not_modify_the_callers_logits():
    logits = LOGITS[None].clone()
    Sampler(model_config())(logits, [make_request(SamplingParams(temperature=0.7, top_k=2, logit_bias={1: 5.0},
                                                                 presence_penalty=1.0), output=[0])])
    assert torch.equal(logits, LOGITS[None])


def test_row_argmax_matches_torch_including_ties_nans_and_all_minus_inf():
    from pagoda.sampling.sampler import argmax_rows

    g = torch.Generator().manual_seed(3)
    for rows, vocab in [(1, 5), (3, 49152), (64, 49152), (7, 33)]:
        x = torch.randn(rows, vocab, generator=g)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    x = torch.zeros(4, 10)
    x[0, [2, 5]] = 1.0  # a tie: the first wins
    x[1, [7, 2]] = float("nan")  # a NaN is the maximum, the first of them
    x[2] = float("-inf")
    got = argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1)) and got.tolist() == [2, 2, 0, 0] and got.dtype == torch.int64
    strided = torch.randn(6, 40, generator=g)[:, ::2]  # not contiguous: torch's own argmax
    assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1))


# ---- degenerate values at the edge of their ranges ---------------------------------------------


def test_a_top_p_that_rounds_to_zero_keeps_only_the_most_likely_token():
    # 1e-300 is 0.0 in float32: the nucleus is the top token, never an empty set sampled as token 0
    counts = draw(SamplingParams(temperature=1.0, top_p=1e-300), LOGITS[[3, 1, 0, 2, 4, 5]], n=500)
    assert counts[2] == 500


def test_an_extreme_repetition_penalty_samples_only_repeated_tokens():
    # a penalty near 0 divides the seen tokens' positive logits into infinity: they win, tied, and nothing is NaN
    logits = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.25, 0.1])
    params = SamplingParams(temperature=1.0, repetition_penalty=1e-300)
    sampler = Sampler(model_config())
    requests = [make_request(params, prompt=(2, 4), rid=str(i)) for i in range(400)]
    tokens = sampler(logits.expand(400, -1).clone(), requests).token_ids
    assert set(tokens) == {2, 4}


def test_top_k_beyond_32_bits_is_refused_with_its_range():
    with pytest.raises(Exception, match=r"top_k=9223372036854775808 is invalid: must be in \[0, 2147483647\]"):
        SamplingParams(top_k=2 ** 63)
    assert SamplingParams(top_k=2 ** 31 - 1).top_k == 2 ** 31 - 1


def test_inverse_cdf_draw_never_takes_a_token_of_probability_zero():
    from pagoda.sampling.sampler import draw_inverse_cdf

    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0], [0.25, 0.25, 0.0, 0.25, 0.25]])
    for u, expected in [(0.0, [1, 2, 0]), (0.3, [3, 2, 1]), (1 - 2 ** -53, [3, 2, 4])]:
        picked = draw_inverse_cdf(probs, torch.full((3,), u, dtype=torch.float64))
        assert picked.tolist() == expected, (u, picked)
    # an unnormalised row draws from its normalised distribution
    n = 20_000
    rows = torch.tensor([2.0, 6.0, 0.0, 2.0]).expand(n, -1).contiguous()
    counts = torch.bincount(draw_inverse_cdf(rows, torch.rand(n, dtype=torch.float64,
                                                              generator=torch.Generator().manual_seed(0))),
                            minlength=4).float()
    assert counts[2] == 0
    assert_frequencies_match(counts, torch.tensor([0.2, 0.6, 0.0, 0.2]))


def test_two_level_draw_takes_the_token_one_running_sum_over_the_row_takes():
    from pagoda.sampling.sampler import CDF_BLOCK, _draw_one_level, draw_inverse_cdf

    gen = torch.Generator().manual_seed(0)
    # whole blocks only, and a last block cut short; float64 so the two levels round alike
    for vocab in (8 * CDF_BLOCK, 3 * CDF_BLOCK + 57):
        probs = torch.softmax(torch.randn(64, vocab, generator=gen, dtype=torch.float64) * 3, dim=-1)
        probs[:, torch.randperm(vocab, generator=gen)[:vocab // 3]] = 0.0  # zeros inside blocks
        for _ in range(20):
            u = torch.rand(64, dtype=torch.float64, generator=gen)
            assert torch.equal(draw_inverse_cdf(probs, u), _draw_one_level(probs, u))


def test_two_level_draw_never_takes_a_token_of_probability_zero_nor_an_empty_block():
    from pagoda.sampling.sampler import CDF_BLOCK, draw_inverse_cdf

    vocab = 4 * CDF_BLOCK + 10
    probs = torch.zeros(3, vocab)
    probs[0, [5, CDF_BLOCK + 40, 2 * CDF_BLOCK + 100]] = torch.tensor([0.2, 0.5, 0.3])  # blocks 3 and 4 empty
    probs[1, vocab - 1] = 1.0  # all of it in the short last block
    probs[2, [0, 3 * CDF_BLOCK]] = 0.5
    for u, expected in [(0.0, [5, vocab - 1, 0]), (0.25, [CDF_BLOCK + 40, vocab - 1, 0]),
                        (0.75, [2 * CDF_BLOCK + 100, vocab - 1, 3 * CDF_BLOCK]),
                        (1 - 2 ** -53, [2 * CDF_BLOCK + 100, vocab - 1, 3 * CDF_BLOCK])]:
        picked = draw_inverse_cdf(probs, torch.full((3,), u, dtype=torch.float64))
        assert picked.tolist() == expected, (u, picked)
    # float32 rows over a vocabulary of many blocks draw from their distribution
    n = 20_000
    row = torch.zeros(vocab)
    row[[7, CDF_BLOCK - 1, CDF_BLOCK, 3 * CDF_BLOCK + 9]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(draw_inverse_cdf(row.expand(n, -1).contiguous(), u), minlength=vocab).float()
    assert counts.sum() == counts[[7, CDF_BLOCK - 1, CDF_BLOCK, 3 * CDF_BLOCK + 9]].sum()
    assert_frequencies_match(counts[[7, CDF_BLOCK - 1, CDF_BLOCK, 3 * CDF_BLOCK + 9]],
                             torch.tensor([0.1, 0.2, 0.3, 0.4]))


def test_temperature_one_over_a_large_vocabulary_samples_the_model_distribution():
    logits = torch.full((3000,), -30.0)
    logits[[3, 700, 2999]] = torch.tensor([0.0, 1.0, 2.0])
    expected = torch.softmax(logits, dim=-1)[[3, 700, 2999]]
    counts = draw(SamplingParams(temperature=1.0), logits, n=NUM_DRAWS)
    assert_frequencies_match(counts[[3, 700, 2999]], expected)


def test_temperature_one_rows_leave_the_callers_logits_alone():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    logits[1, 2] = float("inf")
    before = logits.clone()
    out = Sampler(model_config())(logits, [make_request(SamplingParams(temperature=1.0), rid="a"),
                                           make_request(SamplingParams(temperature=1.0, top_p=0.9), rid="b")])
    assert torch.equal(logits, before)
    assert out.token_ids[1] == 2  # the +inf logit takes the row
