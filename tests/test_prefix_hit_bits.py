"""In the default configuration (bf16, no batch-invariant mode), a prompt gives the same bits whether its first
blocks come from the prefix cache or are computed cold, and whether it is prefilled in one step or in chunks: its
tokens after cached context attend through the same prefill kernel, over the prompt's cached K/V, and the linears
multiply prompt rows through the same GEMM at any row count. Tokens and logprobs are compared with ``==``."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.host import cpu_isa
from pagoda.modeling.default_model import ensure_default_model
from pagoda.plugins.attention.cpu_backend import load_prefill_kernel
from tiny_models import write_tiny_llama

pytestmark = pytest.mark.skipif(cpu_isa.cpu_isa() == "generic",
                                reason=f"the prefill kernel needs AVX2 at least; this CPU runs {cpu_isa.describe()}")

rng = random.Random(53)
PROMPT = [rng.randrange(1000, 30000) for _ in range(75)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)


def bits(llm: LLM, prompt: list[int]) -> tuple:
    """The prompt's greedy token ids and, per position, the chosen and top logprobs (exact floats)."""
    c = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items())) for d in c.logprobs)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    # reductions long enough (K = 256, 512) for their order to show in bf16's roundings
    path = tmp_path_factory.mktemp("tiny-llama-prefix-bits")
    write_tiny_llama(path, seed=5, hidden=256, heads=4, kv_heads=2, head_dim=64, inter=512, norm_noise=0.3)
    return str(path)


def tiny_llm(model: str, **options) -> LLM:
    return LLM(**{**dict(model=model, dtype="bfloat16", max_model_len=256, cpu_threads=2,
                         kv_cache_memory_bytes=16 << 20), **options})


@pytest.fixture(scope="module")
def cold(tiny_model) -> LLM:
    return tiny_llm(tiny_model, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def cached(tiny_model) -> LLM:
    return tiny_llm(tiny_model, enable_prefix_caching=True)


# (tokens shared with an earlier prompt, prompt length): hits of one to four blocks, shared runs that end inside
# a block, suffixes of 1, 8, 15, 16 and 27 tokens (one-token suffixes run beside decodes; eight or fewer rows
# used to take the GEMV)
@pytest.mark.parametrize("shared,length", [(16, 17), (20, 24), (31, 40), (32, 48), (47, 75), (64, 65)])
def test_a_prefix_hit_gives_the_bits_of_a_cold_prefill(cold, cached, shared, length):
    prompt = [100 * shared + length] + PROMPT[1:length]  # a first token of its own: no hit on another case's
    other = prompt[:shared] + [7] + prompt[shared + 1:]
    bits(cached, other)  # caches the blocks the two prompts share
    stats = cached.engine.kv_manager.stats
    hits = stats.hits
    hit = bits(cached, prompt)
    assert stats.hits - hits == min(shared, length - 1) // 16 * 16 > 0
    assert hit == bits(cold, prompt)


@pytest.mark.parametrize("budget", [8, 24])
def test_a_prompt_prefilled_in_chunks_gives_the_bits_of_one_step(tiny_model, cold, budget):
    chunked = tiny_llm(tiny_model, enable_prefix_caching=False, max_num_batched_tokens=budget, max_num_seqs=2)
    assert bits(chunked, PROMPT) == bits(cold, PROMPT)


def test_the_kernel_computes_the_query_rows_asked_for_with_the_bits_of_the_whole_prompt():
    kernel = load_prefill_kernel()
    gen = torch.Generator().manual_seed(11)
    lengths = [40, 75, 16]
    q = torch.randn(sum(lengths), 9, 64, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(sum(lengths), 3, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    ranges = [0, 40, 40, 115, 115, 131]
    whole = torch.zeros_like(q)
    kernel.prefill_attention(q, k, v, whole, ranges, 0.125)
    query_from = [16, 40 + 37, 130]  # block-aligned, inside a block, the last token
    part = torch.full_like(q, 3.0)
    q_part = q.clone()
    for begin, start in zip(ranges[::2], query_from):
        q_part[begin:start // 16 * 16 if start - begin >= 16 else begin] = float("nan")  # never read
    kernel.prefill_attention(q_part, k, v, part, ranges, 0.125, query_from)
    for begin, start, end in zip(ranges[::2], query_from, ranges[1::2]):
        assert torch.equal(part[start:end], whole[start:end])
    with pytest.raises(RuntimeError, match="query_from outside its range"):
        kernel.prefill_attention(q, k, v, part, ranges, 0.125, [16, 20, 130])
    with pytest.raises(RuntimeError, match="one entry per range"):
        kernel.prefill_attention(q, k, v, part, ranges, 0.125, [16])


def test_the_default_model_answers_a_repeated_chat_the_same_from_its_prefix_cache():
    # in the default configuration: the chat whose second answer, a 16-token prefix-cache hit, used to part from
    # the first in bf16
    ensure_default_model()
    llm = LLM(max_model_len=256, cpu_threads=2, kv_cache_memory_bytes=64 << 20)
    assert llm.engine.config.model.dtype == torch.bfloat16 and not llm.engine.config.model.batch_invariant
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    first, second, third = (llm.chat(messages, params, use_tqdm=False)[0].outputs[0] for _ in range(3))
    assert llm.engine.kv_manager.stats.hits >= 32
    assert second.token_ids == first.token_ids == third.token_ids
    lp = [[d[t].logprob for d, t in zip(o.logprobs, o.token_ids)] for o in (first, second, third)]
    assert lp[1] == lp[0] == lp[2]


def test_prompt_rows_get_the_same_bits_from_both_avx2_gemms_at_any_row_count():
    """A long cold prompt's rows go through the row-blocked GEMM (from ``AVX2_ROWS_GEMM_MIN_ROWS`` rows), the
    suffix after a prefix hit through the widened-tile GEMM: each row must come out of both with the same bits,
    in any position and with any number of rows beside it."""
    from pagoda.modeling.layers.fused_ops import (AVX2_ROWS_GEMM_MIN_ROWS, ROWS_GEMM_BLOCK, cpu_ops,
                                                  rows_gemm_chunk)

    ops = cpu_ops()
    if ops is None or not hasattr(ops, "gemm_bf16_fp32_rows"):
        pytest.skip("the AVX2 bf16 GEMMs are not built on this CPU")
    torch.manual_seed(53)
    for n, k in ((576, 576), (1536, 576), (576, 1536), (77, 200)):
        w, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
        x = torch.randn(AVX2_ROWS_GEMM_MIN_ROWS + 37, k).bfloat16()
        whole = ops.gemm_bf16_fp32_rows(x, w, bias, ROWS_GEMM_BLOCK, rows_gemm_chunk(k))
        assert torch.equal(ops.gemm_bf16_fp32(x, w, bias), whole), (n, k)
        for start, stop in ((0, 1), (5, 40), (300, 301), (700, 1061)):
            assert torch.equal(ops.gemm_bf16_fp32(x[start:stop], w, bias), whole[start:stop]), (n, k, start, stop)
