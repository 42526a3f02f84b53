"""The rejection sampler on hand-made distributions: accept/reject rules and the exactness of its output."""

from __future__ import annotations

import torch

from pagoda.sampling.rejection_sampler import RejectionSampler, accept_greedy, accept_sampled
from pagoda.sampling_params import SamplingParams
from pagoda.sequence import Sequence

# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_CRIT_001 = {3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32, 15: 37.70}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def dist(*values: float) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


def draws(gen: torch.Generator, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(k, generator=gen), torch.empty(vocab).exponential_(generator=gen)


def test_greedy_accepts_exactly_the_drafts_that_equal_the_targets_argmax():
    argmax = torch.tensor([5, 7, 9, 11])
    assert accept_greedy(argmax, torch.tensor([5, 7, 9]), 3).token_ids == [5, 7, 9, 11]  # all + bonus
    assert accept_greedy(argmax, torch.tensor([5, 8, 9]), 3).token_ids == [5, 7]  # correction at the 2nd
    assert accept_greedy(argmax, torch.tensor([1, 7, 9]), 3).token_ids == [5]  # none accepted
    assert accept_greedy(argmax[:1], torch.tensor([], dtype=torch.int64), 0).token_ids == [5]


def test_drafts_the_target_is_sure_of_are_all_accepted_and_a_bonus_token_follows():
    # target puts all mass on the drafted tokens; the bonus position on token 3
    p = torch.stack([dist(0, 1, 0, 0), dist(0, 0, 1, 0), dist(0, 0, 0, 1)])
    q = torch.stack([dist(1, 1, 1, 1), dist(1, 1, 1, 1)])
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        verdict = accept_sampled(p, torch.tensor([1, 2]), q, *draws(gen, 2, 4))
        assert verdict.token_ids == [1, 2, 3] and verdict.num_accepted == 2


def test_drafts_the_target_gives_no_mass_are_always_rejected_and_resampled_from_the_target():
    p = torch.stack([dist(0, 1, 1, 0), dist(1, 1, 1, 1)])
    q = torch.stack([dist(0, 0, 0, 1)])  # the draft only ever proposes token 3
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        verdict = accept_sampled(p, torch.tensor([3]), q, *draws(gen, 1, 4))
        assert verdict.num_accepted == 0 and len(verdict.token_ids) == 1
        seen.add(verdict.token_ids[0])
    assert seen == {1, 2}  # the residual max(p - q, 0) is p itself here


def test_partial_acceptance_stops_at_the_first_rejected_draft():
    p = torch.stack([dist(0, 1, 0), dist(1, 0, 0), dist(0, 0, 1)])
    # first draft certain under p, second has p = 0 -> always rejected at position 1
    verdict = accept_sampled(p, torch.tensor([1, 2]), None, torch.tensor([0.5, 0.0]), torch.ones(3))
    assert verdict.num_accepted == 1
    assert verdict.token_ids == [1, 0]  # the correction comes from position 1's distribution


def test_point_mass_drafts_are_accepted_with_the_targets_probability_of_the_draft():
    p = torch.stack([dist(3, 1), dist(1, 1)])
    gen = torch.Generator().manual_seed(1)
    n = 4000
    accepted = sum(accept_sampled(p, torch.tensor([0]), None, *draws(gen, 1, 2)).num_accepted for _ in range(n))
    assert abs(accepted / n - 0.75) < 0.03  # 3 sigma of a binomial(4000, 0.75) is 0.021


def test_first_token_follows_the_target_distribution_whatever_the_draft_distribution():
    gen = torch.Generator().manual_seed(2)
    p = torch.stack([dist(5, 3, 1, 1, 0, 2), dist(1, 1, 1, 1, 1, 1)])
    for q0 in (dist(1, 1, 1, 1, 1, 1), dist(0, 0, 1, 4, 3, 0), dist(5, 3, 1, 1, 0, 2)):
        counts = torch.zeros(6)
        for _ in range(3000):
            draft = torch.multinomial(q0, 1, generator=gen)
            verdict = accept_sampled(p, draft, q0[None], *draws(gen, 1, 6))
            counts[verdict.token_ids[0]] += 1
        assert chi_square(counts, p[0]) < CHI2_CRIT_001[4]  # token 4 has p = 0: 5 categories


def test_two_token_runs_follow_the_targets_joint_distribution_with_point_mass_drafts():
    # a context-free toy target: p(next) depends on nothing, so the joint of two tokens is p x p
    gen = torch.Generator().manual_seed(3)
    p1 = dist(4, 2, 1, 1)
    p = torch.stack([p1, p1, p1])
    counts = torch.zeros(4, 4)
    for _ in range(6000):
        verdict = accept_sampled(p, torch.tensor([0, 0]), None, *draws(gen, 2, 4))
        a, b = verdict.token_ids[:2] if len(verdict.token_ids) >= 2 else (verdict.token_ids[0], None)
        if b is None:
            # rejected at the first position: the second token would come from the next step, drawn
            # from p again; draw it here the same way to complete the pair
            b = int(torch.multinomial(p1, 1, generator=gen))
        counts[a, b] += 1
    assert chi_square(counts.flatten(), torch.outer(p1, p1).flatten()) < CHI2_CRIT_001[15]


def test_the_batch_sampler_gives_seeded_requests_the_same_tokens_every_time():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))

    def run():
        req = Sequence("r", [1, 2], SamplingParams(temperature=1.0, seed=7))
        sampler = RejectionSampler(seed=0)
        return sampler(logits, [0], [req], [[3, 4]], [None])[0].token_ids

    assert run() == run()


def test_requests_whose_distribution_depends_on_earlier_drafts_are_not_speculated():
    def req(num_output: int, eos=2, **kwargs) -> Sequence:
        r = Sequence("r", [1], SamplingParams(**kwargs), eos_token_id=eos)
        r.output_token_ids = [9] * num_output
        return r

    assert req(0, temperature=0.7, top_p=0.9).may_speculate()
    assert not req(3, presence_penalty=0.5).may_speculate()
    assert not req(3, logprobs=2).may_speculate()
    assert not req(4, min_tokens=5).may_speculate()  # EOS is banned for one more token
    assert req(5, min_tokens=5).may_speculate()
    assert req(0, min_tokens=5, ignore_eos=True).may_speculate()  # nothing to ban
    assert not req(0, min_tokens=5, ignore_eos=True, stop_token_ids=[7]).may_speculate()
