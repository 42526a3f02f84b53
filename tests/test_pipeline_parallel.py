"""Pipeline parallelism: the decoder layers split over stages (each of tensor_parallel_size ranks) give the
tokens of the model whole.

The default model's 30 layers split 15/15 over 2 stages; a tiny random model of 3 layers splits 2/1 (and 1/2
when asked), with an LM head of its own on the last stage; the tiny quantized checkpoints of the quant tests
split 1/1, and run on 2 x 2 ranks (tensor parallelism inside each stage). Each rank runs one thread.
"""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError
from pagoda.execution.pipeline import PipelineStage, layer_partition, stage_of
from pagoda.modeling.default_model import ensure_default_model

from quant_helpers import TINY, gptq_checkpoint
from tiny_models import write_tiny_llama

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:",
           " ".join(f"Line {i}: the keeper counted {i * 7 % 13} ships." for i in range(1, 8)), "Hello"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1),
          SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True, logprobs=1)]
TOKEN_PROMPTS = [[1, 5, 9, 100, 200], [1, 300, 17, 44, 45, 46, 250, 12, 90, 91, 300], list(range(3, 60, 3))]


def run(model: str, pp: int = 1, tp: int = 1, prompts: list = PROMPTS, preempts: bool = False,
        params: object = None, in_flight: int = 1, **options) -> list:
    """The outputs of ``prompts``; ``in_flight``: the steps that must have been in the stages at once."""
    # 128 MiB of KV cache (the default model's ~2,900 tokens): each stage's ranks zero, and so hold, the whole cache
    # they are given (2 GiB by default)
    options.setdefault("kv_cache_memory_bytes", 128 << 20)
    llm = LLM(model=model, dtype="float32", max_model_len=256, cpu_threads=1, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, swap_space=0, **options)
    try:
        if prompts and isinstance(prompts[0], list):
            prompts = [{"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(prompts, params or (PARAMS * 4)[:len(prompts)], use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0 or not preempts
        assert llm.engine.most_steps_in_flight == in_flight
        return outputs
    finally:
        llm.engine.shutdown()


def assert_same_tokens(one: list, two: list) -> float:
    """Identical tokens; returns the largest difference of the sampled tokens' logprobs."""
    worst = 0.0
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for token, la, lb in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            worst = max(worst, abs(la[token].logprob - lb[token].logprob))
    return worst


def test_an_even_split_gives_the_earlier_stages_the_extra_layers_and_each_rank_its_neighbours():
    assert layer_partition(30, 2) == (15, 15)
    assert layer_partition(7, 3) == (3, 2, 2)
    # rank = stage x tensor_parallel_size + tensor-parallel index
    assert stage_of(3, 2, (3, 2, 2)) == PipelineStage(1, 3, 3, 5, prev_rank=1, next_rank=5)
    assert stage_of(0, 2, (3, 2, 2)) == PipelineStage(0, 3, 0, 3, prev_rank=None, next_rank=2)
    assert stage_of(5, 2, (3, 2, 2)).is_last


def test_two_stages_give_the_default_model_s_tokens_through_preemption():
    model = str(ensure_default_model())
    # a pool this small preempts; the same block count on both sides keeps the schedules alike
    pool = dict(num_gpu_blocks_override=9, max_num_batched_tokens=48, max_num_seqs=8, preempts=True,
                prompts=PROMPTS * 2)
    # two steps in flight (the default with two stages), each of other sequences
    worst = assert_same_tokens(run(model, **pool), run(model, pp=2, in_flight=2, **pool))
    print(f"default model, PP=2 vs PP=1: largest logprob difference {worst:.2e}")
    assert worst < 1e-3


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """3 decoder layers (they split unevenly over 2 stages), 4 query heads on 2 KV heads, untied LM head."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("three-layers"), hidden=64, heads=4, kv_heads=2, head_dim=16,
                                inter=96, vocab=512, layers=3, norm_noise=0.1, tokenizer_dir=TINY))


@pytest.fixture(scope="module")
def one_stage(three_layers):
    """The three-layer model's outputs of TOKEN_PROMPTS whole, on one rank: what every split of it must give."""
    return run(three_layers, prompts=TOKEN_PROMPTS)


@pytest.fixture(scope="module")
def one_stage_greedy(three_layers):
    """The greedy tokens of TOKEN_PROMPTS, 8 each, on one rank."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in run(three_layers, prompts=TOKEN_PROMPTS, params=greedy)]


@pytest.mark.parametrize("partition, micro_batches, in_flight", [(None, 1, 2), ("1,2", 1, 2), (None, 2, 2),
                                                                (None, 1, 1)])
def test_three_layers_over_two_stages_give_the_tokens_of_one(three_layers, one_stage, partition, micro_batches,
                                                             in_flight):
    worst = assert_same_tokens(one_stage,
                               run(three_layers, pp=2, prompts=TOKEN_PROMPTS, pipeline_layer_partition=partition,
                                   pipeline_micro_batches=micro_batches, pipeline_batches_in_flight=in_flight,
                                   in_flight=in_flight))
    assert worst < 1e-4


@pytest.mark.parametrize("limits", [dict(num_gpu_blocks_override=4, preempts=True), dict(max_num_seqs=3)],
                         ids=["four-blocks", "three-seats"])
def test_many_more_requests_than_fit_give_the_tokens_of_one_with_steps_in_flight(three_layers, limits):
    """Nine requests of up to 27 tokens in four blocks of 16 (they are preempted and computed again, in each lane
    of steps), or with three seats (one lane takes them all at first, then shares them): the tokens of one
    stage, with two steps in flight."""
    options = dict(prompts=TOKEN_PROMPTS * 3, params=(PARAMS * 5)[:9], **limits)
    worst = assert_same_tokens(run(three_layers, **options), run(three_layers, pp=2, in_flight=2, **options))
    assert worst < 1e-4


def test_an_abort_in_flight_frees_the_request_s_blocks_when_its_step_is_collected(three_layers, one_stage_greedy):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    clean = one_stage_greedy
    llm = LLM(model=three_layers, dtype="float32", max_model_len=256, cpu_threads=1, pipeline_parallel_size=2,
              swap_space=0, kv_cache_memory_bytes=16 << 20)
    engine, kv = llm.engine, llm.engine.kv_manager
    try:
        for i, prompt in enumerate(TOKEN_PROMPTS):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, greedy)
        done = {}
        while not engine.is_in_flight("r1"):
            done.update((out.request_id, out) for out in engine.step() if out.finished)
        held = kv.num_blocks_held("r1")
        engine.abort_request("r1")
        assert held > 0 and kv.num_blocks_held("r1") == held  # the later stage may still write them
        while engine.is_in_flight("r1"):
            done.update((out.request_id, out) for out in engine.step() if out.finished)
        assert kv.num_blocks_held("r1") == 0
        while engine.has_unfinished_requests():
            done.update((out.request_id, out) for out in engine.step() if out.finished)
        assert engine.most_steps_in_flight == 2
        assert kv.num_free_blocks == engine.num_blocks
    finally:
        engine.shutdown()
    assert "r1" not in done
    assert [done["r0"].outputs[0].token_ids, done["r2"].outputs[0].token_ids] == [clean[0], clean[2]]


def test_two_by_two_ranks_give_the_tokens_of_one(three_layers, one_stage):
    worst = assert_same_tokens(one_stage,
                               run(three_layers, pp=2, tp=2, prompts=TOKEN_PROMPTS, in_flight=2))
    assert worst < 1e-4


def test_a_quantized_checkpoint_splits_by_stage(tmp_path):
    gptq_checkpoint(tmp_path, group=32)
    worst = assert_same_tokens(run(str(tmp_path), prompts=TOKEN_PROMPTS),
                               run(str(tmp_path), pp=2, prompts=TOKEN_PROMPTS, in_flight=2))
    assert worst < 1e-4


@pytest.mark.parametrize("options, message", [
    (dict(pipeline_parallel_size=3), r"pipeline_parallel_size=3 is more than the model's 2 decoder layers"),
    (dict(pipeline_parallel_size=2, pipeline_layer_partition="1,2"), "sums to 3 layers but the model has 2"),
    (dict(pipeline_parallel_size=2, pipeline_layer_partition="2"), "has 1 stage"),
    (dict(pipeline_parallel_size=2, pipeline_layer_partition="one,one"), "is not comma-separated layer counts"),
    (dict(pipeline_layer_partition="1,1"), "needs --pipeline-parallel-size > 1"),
    (dict(pipeline_micro_batches=2), "needs --pipeline-parallel-size > 1"),
    (dict(pipeline_batches_in_flight=2), "needs --pipeline-parallel-size > 1"),
    (dict(pipeline_parallel_size=2, pipeline_batches_in_flight=3), "is more than the 2 pipeline stages"),
    (dict(pipeline_parallel_size=2, distributed_executor_backend="uni"), "uni executor runs one process"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative decoding does not run over pipeline stages"),
    (dict(pipeline_parallel_size=2, enable_lora=True), "LoRA does not run with pipeline parallelism"),
    (dict(pipeline_parallel_size=2, kv_offload_ram=0.1), "do not keep K/V per pipeline stage"),
])
def test_what_pipeline_parallelism_cannot_run_is_refused_before_any_process_starts(options, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(TINY), dtype="float32", **options)


def test_a_request_failing_in_the_first_stage_ends_alone_and_the_stages_stay_in_step(three_layers, one_stage_greedy):
    """A fault raised in the driver's stage mid-step: the later stage is handed a placeholder, the engine re-runs
    the step in parts (once the step in flight ahead of it is collected), the faulty request ends with an error
    and the others get the tokens of a clean run."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    clean = one_stage_greedy
    used = {t for p in TOKEN_PROMPTS for t in p} | {t for ids in clean for t in ids}
    poison = next(t for t in range(3, 512) if t not in used)
    llm = LLM(model=three_layers, dtype="float32", max_model_len=256, cpu_threads=1, pipeline_parallel_size=2,
              swap_space=0, pipeline_micro_batches=2, kv_cache_memory_bytes=16 << 20)
    seen = []

    def maybe_raise(module, args, output):
        if bool((seen[-1] == poison).any()):
            raise RuntimeError("injected fault")

    model = llm.engine.model
    hooks = [model.register_forward_pre_hook(lambda module, args: seen.append(args[0])),
             model.layers[0].register_forward_hook(maybe_raise)]
    engine = llm.engine
    try:
        for i, prompt in enumerate([*TOKEN_PROMPTS, [1, poison, 7]]):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, greedy)
        done = {}
        while engine.has_unfinished_requests():
            done.update((out.request_id, out) for out in engine.step() if out.finished)
        assert engine.most_steps_in_flight == 2  # the faulty request's step was in flight beside another
    finally:
        for hook in hooks:
            hook.remove()
        engine.shutdown()
    assert done["r3"].outputs[0].finish_reason == "error" and "injected fault" in done["r3"].error
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(3)] == clean
