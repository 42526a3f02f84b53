"""Quantized checkpoints split over 2 ranks (tensor parallelism over gloo) give the tokens of 1 rank.

Each rank loads only its part of the packed tensors: the output channels of column-parallel layers (QKV,
gate/up), the input features of row-parallel ones (o, down), whole words and whole scale groups.
"""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError

from quant_helpers import (PROMPTS, awq_checkpoint, compressed_int_checkpoint, fp8_checkpoint,
                           gptq_checkpoint, write_dense, tiny_linears)

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=12, min_tokens=12, temperature=0, ignore_eos=True, logprobs=0)

CHECKPOINTS = {
    "awq-g32": lambda d: awq_checkpoint(d, group=32),
    "gptq-g32": lambda d: gptq_checkpoint(d, group=32),
    "gptq-channel": lambda d: gptq_checkpoint(d, group=-1),
    "compressed-int4-channel": lambda d: compressed_int_checkpoint(d, group=None),
    # static activation scales: dynamic ones are taken per token over each rank's own input features (as GPU
    # engines do under tensor parallelism), which moves the results of a row-parallel layer slightly
    "fp8-block-static": lambda d: fp8_checkpoint(d, activation_scheme="static", block=(32, 32)),
}


def run(path, tp: int, **options) -> list:
    llm = LLM(str(path), dtype="float32", cpu_threads=1, tensor_parallel_size=tp, kv_cache_memory_bytes=16 << 20,
              swap_space=0, **options)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def assert_same(one: list, two: list) -> float:
    worst = 0.0
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for t, la, lb in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            worst = max(worst, abs(la[t].logprob - lb[t].logprob))
    return worst


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_quantized_checkpoint_on_two_ranks_gives_the_tokens_of_one(name, tmp_path):
    CHECKPOINTS[name](tmp_path)
    worst = assert_same(run(tmp_path, 1), run(tmp_path, 2))
    print(f"{name}: TP=2 vs TP=1, largest logprob difference {worst:.2e}")
    assert worst < 1e-3


def test_online_fp8_on_two_ranks_gives_the_tokens_of_one(tmp_path):
    dense = write_dense(tmp_path, tiny_linears())
    worst = assert_same(run(dense, 1, quantization="fp8"), run(dense, 2, quantization="fp8"))
    assert worst < 1e-3


def test_splits_that_would_cut_a_group_or_need_every_group_are_refused(tmp_path):
    # o_proj's 128 input features split 64/64: a group of 128 would be cut in two
    gptq_checkpoint(tmp_path / "g128", group=128)
    with pytest.raises(ConfigError, match="o_proj: this rank's 64 input features from 0 split GPTQ's groups"):
        run(tmp_path / "g128", 2)
    gptq_checkpoint(tmp_path / "act", group=32, desc_act=True)
    with pytest.raises(ConfigError, match="act-order \\(desc_act\\) is not split over input features"):
        run(tmp_path / "act", 2)


def test_online_int8_on_two_ranks_moves_logprobs_no_more_than_int8_itself_does(tmp_path):
    # W8A8: each token's activation scale is taken over the rank's own input features of a row-parallel
    # layer (as GPU engines do), so the logprobs move from one rank's; by no more than quantizing moves them
    dense = write_dense(tmp_path, tiny_linears())
    first = SamplingParams(max_tokens=1, temperature=0, logprobs=5)

    def top5(tp: int, **options) -> list[dict[int, float]]:
        llm = LLM(str(dense), dtype="float32", cpu_threads=1, tensor_parallel_size=tp,
                  kv_cache_memory_bytes=16 << 20, swap_space=0, **options)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], first, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    def largest_move(xs: list[dict], ys: list[dict]) -> float:
        return max(abs(x[t] - y[t]) for x, y in zip(xs, ys) for t in x.keys() & y.keys())

    int8_one, int8_two, dense_one = top5(1, quantization="int8"), top5(2, quantization="int8"), top5(1)
    moved_by_ranks, moved_by_int8 = largest_move(int8_two, int8_one), largest_move(int8_one, dense_one)
    print(f"int8 TP=2 vs TP=1: {moved_by_ranks:.3f}; int8 vs float32 on one rank: {moved_by_int8:.3f}")
    assert 0 < moved_by_ranks <= 1.5 * moved_by_int8
