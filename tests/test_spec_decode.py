"""Speculative decoding end to end: same greedy tokens as plain decoding, the target's distribution
when sampling, KV blocks released, counters, mixed batches and config errors."""

from __future__ import annotations

import pytest
import torch

from one_engine import release
from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError

# 128 MiB of KV cache, ample for these prompts
KV = 128 << 20
# the default model in bf16, the batch-invariant mode making its greedy tokens the same bits whatever else ran in a
# step: a verified run of drafts, a batch of 4, preemption (docs/batch_invariance.md)
BF16 = dict(dtype="bfloat16", batch_invariant=True)
# the prompts are 13, 36, 5 and 13 tokens long: with this many output tokens one sequence needs at most 4 blocks
# of 16 tokens, all four together 12
MAX_TOKENS = 24
TIGHT_BLOCKS = 8
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
SELF_DRAFT = {"method": "draft_model", "model": "self:layers=8", "num_speculative_tokens": 4}

PROMPTS = [
    "Repeat after me: red green blue red green blue red green blue",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The capital of France is",
    "List the days of the week: Monday, Tuesday, Wednesday,",
]
# chi-square critical value at p = 0.001 by degrees of freedom
CHI2_CRIT_001 = {3: 16.27, 5: 20.52, 7: 24.32, 8: 26.12, 11: 31.26, 15: 37.70}


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture
def build():
    """``build(*args, **kwargs)`` is ``LLM(*args, **kwargs)``; every engine a test built is shut down and freed
    when the test ends."""
    built: list[LLM] = []

    def make(*args, **kwargs) -> LLM:
        built.append(LLM(*args, **kwargs))
        return built[-1]

    yield make
    while built:
        release(built.pop())


@pytest.fixture(scope="module")
def plain_greedy():
    llm = LLM(**BF16, cpu_threads=1, kv_cache_memory_bytes=KV)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    tokens = {
        "batch": generate(llm, PROMPTS, params),
        "single": generate(llm, PROMPTS[:1], params),
    }
    release(llm)
    del llm
    return tokens


def assert_no_blocks_held(llm: LLM) -> None:
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert not llm.engine.scheduler.has_unfinished_requests()


# each proposer under one preemption mode: n-gram drafts under recompute, the self-draft (whose drafts read the
# target's own first layers' cache) under swap, its blocks copied out and back with the target's
@pytest.mark.slow
@pytest.mark.parametrize("spec, mode", [(NGRAM, "recompute"), (SELF_DRAFT, "swap")],
                         ids=["ngram-recompute", "self-draft-swap"])
def test_greedy_speculation_gives_the_plain_tokens_alone_and_in_a_batch_of_4_that_preempts(plain_greedy, build, spec,
                                                                                           mode):
    # one sequence fits in the blocks, but 4 start together and someone must be preempted
    swap = {"swap_space": 0.05} if mode == "swap" else {}
    llm = build(**BF16, cpu_threads=1, speculative_config=spec, num_gpu_blocks_override=TIGHT_BLOCKS,
                preemption_mode=mode, **swap)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    assert generate(llm, PROMPTS[:1], params) == plain_greedy["single"], "batch size 1"
    assert llm.engine.scheduler.num_preemptions == 0
    assert generate(llm, PROMPTS, params) == plain_greedy["batch"], f"batch size 4, with {mode} preemption"
    assert llm.engine.scheduler.num_preemptions > 0
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_drafts > 0
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert_no_blocks_held(llm)
    if spec is NGRAM:
        assert stats.acceptance_rate > 0.1  # the prompts repeat themselves (about 0.2 measured)


# ---- tiny random models ------------------------------------------------------------


# the tiny models' vocabulary: what these tests check does not depend on its size, and top-k sorts each row of
# logits at every step (600 rows a step in the sampling tests)
TINY_VOCAB = 512


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from tiny_models import write_tiny_llama

    target, draft = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    write_tiny_llama(target, seed=0, vocab=TINY_VOCAB)
    write_tiny_llama(draft, seed=1, vocab=TINY_VOCAB)
    return target, draft


def tiny_llm(make, model_dir, spec=None, **kwargs) -> LLM:
    """An engine on a tiny checkpoint, built by ``make`` (the ``build`` fixture, or ``LLM``)."""
    return make(str(model_dir), dtype="float32", cpu_threads=1, kv_cache_memory_bytes=32 << 20,
                speculative_config=spec, **kwargs)


@pytest.fixture(scope="module")
def plain_target(tiny_models):
    """The target without speculation, the reference of the tiny-model tests."""
    llm = tiny_llm(LLM, tiny_models[0])
    yield llm
    release(llm)
    del llm


# a large bias confines sampling to tokens 5, 6, 7 (top-k 3 keeps exactly them), which the prompt holds, so
# n-gram lookup finds matches and the drafts agree with the target often
SAMPLED_PROMPT = [5, 6, 7, 9, 5, 6, 7, 9, 5, 6]
SAMPLED_SUPPORT = [5, 6, 7]


@pytest.fixture(scope="module")
def target_joint(plain_target):
    return exact_joint(plain_target, SAMPLED_PROMPT, SAMPLED_SUPPORT)


def exact_joint(llm: LLM, prompt: list[int], support: list[int]) -> dict[tuple[int, int], float]:
    """The exact distribution of ``llm``'s first two tokens when sampling is confined to ``support``
    (temperature 1): from the raw log-probabilities of every two-token continuation."""
    pairs = [(a, b) for a in support for b in support]
    outs = llm.generate([{"prompt_token_ids": prompt + list(pair)} for pair in pairs],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    # [pair][position] raw log-probability of the pair's tokens
    lp = {pair: (o.prompt_logprobs[-2][pair[0]].logprob, o.prompt_logprobs[-1][pair[1]].logprob)
          for pair, o in zip(pairs, outs)}
    first = torch.softmax(torch.tensor([lp[(a, support[0])][0] for a in support]), 0).tolist()
    joint = {}
    for i, a in enumerate(support):
        second = torch.softmax(torch.tensor([lp[(a, b)][1] for b in support]), 0).tolist()
        for j, b in enumerate(support):
            joint[(a, b)] = first[i] * second[j]
    return joint


@pytest.mark.slow
@pytest.mark.parametrize("which", ["ngram", "self-draft", "checkpoint-draft"])
def test_sampled_tokens_follow_the_targets_exact_distribution(tiny_models, target_joint, build, which):
    target, draft = tiny_models
    prompt, support, joint = SAMPLED_PROMPT, SAMPLED_SUPPORT, target_joint
    spec = {"ngram": NGRAM, "self-draft": {"method": "draft_model", "model": "self:layers=1",
                                           "num_speculative_tokens": 3},
            "checkpoint-draft": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}}[which]
    llm = tiny_llm(build, target, spec)
    num_samples = 600
    # 3 tokens: the second step verifies one draft, so token 2 is an accepted draft or a correction
    params = [SamplingParams(temperature=1.0, top_k=3, logit_bias={t: 30.0 for t in support}, max_tokens=3,
                             ignore_eos=True, seed=1000 + i)
              for i in range(num_samples)]
    outs = generate(llm, [{"prompt_token_ids": prompt}] * num_samples, params)
    counts: dict[tuple[int, int], int] = {}
    for ids in outs:
        counts[tuple(ids[:2])] = counts.get(tuple(ids[:2]), 0) + 1
    assert set(counts) <= set(joint), "a pair outside the target's top-k support was emitted"
    chi2 = sum((counts.get(pair, 0) - num_samples * p) ** 2 / (num_samples * p) for pair, p in joint.items())
    assert chi2 < CHI2_CRIT_001[len(joint) - 1]
    stats = llm.engine.spec_stats
    assert stats.num_drafts >= num_samples // 2  # the second tokens really were speculated
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both accept and reject paths ran


@pytest.mark.slow
def test_a_checkpoint_draft_gives_the_plain_greedy_tokens_with_its_own_kv_cache(tiny_models, plain_target, build):
    target, draft = tiny_models
    gen = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist()} for n in (9, 30, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = generate(plain_target, prompts, params)
    # the target as its own draft: every draft is accepted, so a stale draft cache would show as rejections
    llm = tiny_llm(build, target, {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3},
                   max_num_batched_tokens=24, max_num_seqs=3)
    assert generate(llm, prompts, params) == expected
    assert llm.engine.spec_stats.acceptance_rate == 1.0
    assert_no_blocks_held(llm)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_checkpoint_drafts_cache_follows_its_blocks_through_preemption(tiny_models, plain_target, build, mode):
    target, _ = tiny_models
    gen = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist()}
               for n in (20, 26, 14, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = generate(plain_target, prompts, params)
    llm = tiny_llm(build, target, {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3},
                   num_gpu_blocks_override=9, preemption_mode=mode, swap_space=0.01)
    assert generate(llm, prompts, params) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    # the target drafting for itself accepts everything only if the draft's cache came back intact
    assert llm.engine.spec_stats.acceptance_rate == 1.0
    assert_no_blocks_held(llm)


@pytest.mark.slow
def test_mixed_batches_keep_greedy_tokens_and_reproduce_seeded_samples(tiny_models, plain_target, build):
    target, _ = tiny_models
    gen = torch.Generator().manual_seed(6)
    prompts = [{"prompt_token_ids": torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist()} for n in (8, 20, 12, 5)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, ignore_eos=True, seed=3),
              SamplingParams(temperature=1.0, presence_penalty=0.5, max_tokens=10, ignore_eos=True, seed=4),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)]
    spec = {"method": "draft_model", "model": "self:layers=1", "num_speculative_tokens": 3}
    plain = generate(plain_target, prompts, params)
    first = generate(tiny_llm(build, target, spec), prompts, params)
    again = generate(tiny_llm(build, target, spec), prompts, params)
    assert first[0] == plain[0] and first[3] == plain[3]  # greedy rows, with and without drafts
    assert first[2] == plain[2]  # penalties: decoded one token per step by the plain sampler
    assert first == again  # seeded sampling is reproducible with speculation on


@pytest.mark.slow
def test_stop_tokens_inside_an_accepted_run_end_the_request_there(tiny_models, plain_target, build):
    target, _ = tiny_models
    prompt = {"prompt_token_ids": [11, 12, 13, 14, 15, 16]}
    base = generate(plain_target, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    stop_at = base[5]
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4}  # accepts everything
    llm = tiny_llm(build, target, spec)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at])
    out = generate(llm, [prompt], params)[0]
    assert out == base[:base.index(stop_at) + 1]
    assert generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))[0] == base[:7]
    assert_no_blocks_held(llm)


def test_a_self_draft_deeper_than_the_target_is_a_config_error(tiny_models):
    target, _ = tiny_models
    with pytest.raises(ConfigError, match="self:layers=N"):
        tiny_llm(LLM, target, {"method": "draft_model", "model": "self:layers=2", "num_speculative_tokens": 2})


def test_an_unknown_proposer_is_a_config_error_listing_the_available_ones(tiny_models):
    target, _ = tiny_models
    with pytest.raises(ConfigError, match="'ngram'"):
        tiny_llm(LLM, target, {"method": "medusa", "num_speculative_tokens": 2})


@pytest.mark.slow
def test_acceptance_counters_are_exported_with_the_servers_metrics(tiny_models, build):
    from pagoda.engine.metrics import PrometheusExporter

    target, _ = tiny_models
    llm = tiny_llm(build, target, {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3},
                   disable_log_stats=False)
    generate(llm, [{"prompt_token_ids": [3, 4, 5, 6]}], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    stats = llm.engine.spec_stats
    # 1 token from the prefill, then runs of 3 accepted drafts + 1 bonus: 4 + 4 tokens
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 6)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 2]
    assert stats.acceptance_rate == 1.0 and stats.mean_acceptance_length == 4.0
    assert llm.engine.stats.num_generation_tokens == 9
    text = PrometheusExporter.for_engine(llm.engine).render().decode()
    assert 'pagoda:spec_decode_num_drafts_total{model_name=' in text
    assert 'pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="' in text
    assert 'position="2"} 2.0' in text
