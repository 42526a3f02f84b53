"""Prefix caching and copy-on-write with the real default model: reuse changes how much is computed,
never what is generated.
"""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.modeling.default_model import ensure_default_model
from one_engine import release

pytestmark = pytest.mark.slow

rng = random.Random(7)
SHARED = [rng.randrange(1000, 30000) for _ in range(40)]
# one shared 40-token prefix, distinct tails of lengths that end in different block offsets
PROMPTS = [SHARED + [rng.randrange(1000, 30000) for _ in range(k)] for k in (1, 7, 16, 25)]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=50, seed=12, max_tokens=10, ignore_eos=True),
]


def make_llm(**kwargs) -> LLM:
    ensure_default_model()
    # bf16 in the batch-invariant mode: a prefix-cache hit gives the bits of a cold prefill (docs/batch_invariance.md)
    return LLM(dtype="bfloat16", batch_invariant=True, max_model_len=256, kv_cache_memory_bytes=24 << 20,
               cpu_threads=1, **kwargs)


def generate(llm: LLM, prompts, params) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def uncached():
    """The tokens of PROMPTS with PARAMS on an engine without prefix caching, freed before the cached one is built
    (one copy of the default model at a time)."""
    llm = make_llm(enable_prefix_caching=False)
    try:
        return generate(llm, PROMPTS, PARAMS)
    finally:
        release(llm)
        del llm


@pytest.fixture(scope="module")
def cached():
    llm = make_llm(enable_prefix_caching=True)
    yield llm
    release(llm)  # nothing the module built stays in the worker
    del llm


def test_prefix_caching_generates_the_same_tokens_greedy_and_seeded(uncached, cached):
    reference = uncached
    stats = cached.engine.kv_manager.stats
    first = generate(cached, PROMPTS, PARAMS)
    hits_first = stats.hits
    second = generate(cached, PROMPTS, PARAMS)  # every full block is now cached
    assert first == reference and second == reference
    assert hits_first >= 3 * 32  # the later prompts reuse the shared prefix's two full blocks
    assert stats.hits - hits_first >= sum((len(p) - 1) // 16 * 16 for p in PROMPTS)


def test_prefix_cache_counters_are_in_tokens_and_outputs_report_cached_tokens(cached):
    stats = cached.engine.kv_manager.stats
    prompt = [rng.randrange(1000, 30000) for _ in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    queries, hits = stats.queries, stats.hits
    cached.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert (stats.queries - queries, stats.hits - hits) == (40, 0)
    out = cached.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert (stats.queries - queries, stats.hits - hits) == (80, 32)
    assert out.num_cached_tokens == 32


def test_n_sequences_share_the_prompt_and_copy_on_write_without_changing_tokens(cached):
    engine = cached.engine
    copies = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        sched = schedule()
        copies.extend(sched.blocks_to_copy)
        return sched

    engine.scheduler.schedule = recording_schedule
    try:
        prompt = PROMPTS[2]  # 56 tokens: its last prompt block is partly filled
        together = generate(cached, [prompt], SamplingParams(n=3, temperature=0.8, seed=40, max_tokens=8,
                                                             ignore_eos=True))[0]
    finally:
        engine.scheduler.schedule = schedule
    assert len(copies) == 2  # the two later sequences each copied the shared partial block once
    separately = generate(cached, [prompt] * 3, [SamplingParams(temperature=0.8, seed=40 + i, max_tokens=8,
                                                                ignore_eos=True) for i in range(3)])
    assert together == [s[0] for s in separately]
    assert engine.kv_manager.num_free_blocks == engine.num_blocks
