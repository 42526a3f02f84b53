"""Tensor parallelism with the mp executor: 2 ranks (the default all-reduce: shared memory on this CPU host) give
the tokens of 1 rank.

The default model's 9 query heads and 3 KV heads split 3/6 and 1/2 over 2 ranks; the tiny model's single KV
head is held by both ranks, its 3 query heads split 1/2, its MLP and vocabulary unevenly, and its LM head is
not tied to the embedding. Each rank runs one thread.
"""

from __future__ import annotations

import dataclasses
import gc
import time

import pytest

from pagoda import LLM, SamplingParams, hookimpl
from pagoda.engine.components import build_components
from pagoda.engine.engine_args import EngineArgs
from pagoda.errors import ConfigError
from pagoda.modeling.default_model import ensure_default_model
from pagoda.modeling.models.llama import LlamaForCausalLM
from pagoda.registry.plugin_manager import PluginManager
from tiny_models import write_tiny_llama

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:",
           " ".join(f"Line {i}: the keeper counted {i * 7 % 13} ships." for i in range(1, 10)), "Hello"]
# 8 tokens each: the 8 requests need 304 slots of KV cache (240 of them their prompts), SMALL_POOL holds 192, so
# the runs given it still preempt
PARAMS = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1),
          SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True, logprobs=1)]


def run(tp: int, model: str, preempts: bool = False, num_requests: int = 8, **options) -> list:
    # 128 MiB of KV cache (about 2,900 tokens of the default model; SMALL_POOL's block count overrides it)
    options.setdefault("kv_cache_memory_bytes", 128 << 20)
    llm = LLM(model=model, dtype="float32", max_model_len=512, cpu_threads=1, tensor_parallel_size=tp, **options)
    try:
        outputs = llm.generate((PROMPTS * 2)[:num_requests], (PARAMS * 4)[:num_requests], use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0 or not preempts
        return outputs
    finally:
        llm.engine.shutdown()


def assert_same_tokens(one: list, two: list) -> float:
    """Identical tokens; returns the largest difference of the sampled tokens' logprobs."""
    worst = 0.0
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, a.prompt
        for token, la, lb in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            worst = max(worst, abs(la[token].logprob - lb[token].logprob))
    return worst


# a pool this small preempts; the same block count on both sides keeps the schedules alike
SMALL_POOL = dict(num_gpu_blocks_override=12, max_num_batched_tokens=48, max_num_seqs=8)


@pytest.fixture(scope="module")
def one_rank_outputs():
    """The default model's outputs on one rank with room for every request (no preemption): what two ranks must
    give whatever their schedule, preempted by recompute or by swap (Ray actors as ranks: test_ray_cluster.py)."""
    return run(1, str(ensure_default_model()))


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_two_ranks_give_the_default_model_s_tokens(one_rank_outputs, preemption_mode):
    model = str(ensure_default_model())
    options = dict(SMALL_POOL, preemption_mode=preemption_mode, swap_space=0.05, preempts=True)
    worst = assert_same_tokens(one_rank_outputs, run(2, model, **options))
    print(f"default model, TP=2 preempted by {preemption_mode} vs TP=1: largest logprob difference {worst:.2e}")
    assert worst < 1e-3


@pytest.fixture(scope="module")
def uneven_model(tmp_path_factory):
    """3 query heads sharing 1 KV head, MLP 99 wide, an odd vocabulary, untied LM head: random weights."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("uneven"), hidden=96, heads=3, kv_heads=1, head_dim=32,
                                inter=99, vocab=49153))


def test_two_ranks_give_the_tokens_of_one_when_heads_divide_unevenly(uneven_model):
    worst = assert_same_tokens(run(1, uneven_model), run(2, uneven_model))
    print(f"uneven tiny model, TP=2 vs TP=1: largest logprob difference {worst:.2e}")
    assert worst < 1e-3


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=4), "more than the model's 3 KV heads and not a multiple"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "uni executor runs one process"),
    (dict(tensor_parallel_size=2, speculative_config={"method": "draft_model", "model": "/some/draft",
                                                      "num_speculative_tokens": 2}),
     "a draft checkpoint is not sharded for tensor parallelism yet"),
    (dict(distributed_executor_backend="raft"), r"unknown executor 'raft'.*'mp'.*'ray'.*'uni'"),
])
def test_what_tensor_parallelism_cannot_run_is_refused_before_any_process_starts(options, message):
    with pytest.raises(ConfigError, match=message):
        LLM(dtype="float32", max_model_len=256, **options)


def test_the_executors_are_plugins():
    pm = PluginManager().load()
    assert {"uni", "mp", "ray"} <= set(pm.names("pagoda_executors"))
    assert pm.get("pagoda_executors", "mp", "test").dist == "pagoda (built-in)"


SPEC_PROMPTS = ["The list: apple, banana, cherry, apple, banana, cherry, apple,",
                "def add(a, b):\n    return a + b\n\ndef add(a, b):", "one two three four one two three four one"]


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "draft_model", "model": "self:layers=8", "num_speculative_tokens": 2}])
def test_speculation_over_two_ranks_drafts_accepts_and_samples_as_one_rank(spec):
    """Every rank drafts and verifies alike (same tokens, same seeds): the same tokens, greedy and seeded, and the
    same acceptance counts as speculation on one rank."""
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)]
    results = []
    for tp in (1, 2):
        llm = LLM(dtype="float32", max_model_len=512, cpu_threads=1, kv_cache_memory_bytes=64 << 20,
                  tensor_parallel_size=tp, speculative_config=spec)
        try:
            outputs = llm.generate(SPEC_PROMPTS * 2, params * 3, use_tqdm=False)
            results.append(([o.outputs[0].token_ids for o in outputs], vars(llm.engine.spec_stats)))
        finally:
            llm.engine.shutdown()
    assert results[0] == results[1]
    assert results[1][1]["num_accepted_tokens"] > 0


def test_an_architecture_that_does_not_shard_itself_is_refused():
    class Unsharded(LlamaForCausalLM):
        supports_tensor_parallel = False

    class Plugin:
        @hookimpl
        def pagoda_model_architectures(self):
            return {"UnshardedLlama": Unsharded}

    pm = PluginManager().load()
    pm.register(Plugin(), name="unsharded")
    config = EngineArgs(model=str(ensure_default_model()), tensor_parallel_size=2).create_engine_config()
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, architecture="UnshardedLlama"))
    with pytest.raises(ConfigError, match="UnshardedLlama architecture .* does not shard itself"):
        build_components(config, pm)


def test_pagoda_serve_runs_two_ranks_behind_the_openai_routes_and_stops_them(one_rank_outputs, tmp_path):
    import signal
    from pathlib import Path

    import openai

    from serve_process import start_server

    offline = one_rank_outputs[0]  # greedy, on one rank
    assert offline.prompt == "The capital of France is" and PARAMS[0].temperature == 0.0

    def running(pid: int) -> bool:
        try:
            return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
        except FileNotFoundError:
            return False

    def children(pid: int) -> list[int]:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]

    proc, url = start_server(tmp_path / "serve.log", "--tensor-parallel-size", "2")
    try:
        # the fork server the rank was forked from (multiprocessing's resource tracker beside it)
        servers = [pid for pid in children(proc.pid) if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(servers) == 1, "the server should have started one fork server for its ranks"
        ranks = children(servers[0])
        assert len(ranks) == 1, "the fork server should have forked the server's second rank"
        descendants = children(proc.pid) + ranks
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        answer = client.completions.create(model="SmolLM2-135M-Instruct", prompt=offline.prompt,
                                           max_tokens=PARAMS[0].max_tokens, temperature=0.0,
                                           extra_body={"ignore_eos": True})
        assert answer.choices[0].text == offline.outputs[0].text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert not any(running(pid) for pid in ranks)  # the server waited for its rank before it exited
    # the fork server and the resource tracker end on their own once the server has gone
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in descendants) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(running(pid) for pid in descendants)


@pytest.fixture(scope="module")
def torch_backend_two_ranks():
    """The default model on two ranks with the torch attention backend: one engine for the two tests below (the
    second loses a rank, then shuts the engine down, so this process can run another tensor-parallel engine)."""
    llm = LLM(model=str(ensure_default_model()), dtype="float32", max_model_len=512, cpu_threads=1,
              kv_cache_memory_bytes=128 << 20, tensor_parallel_size=2, attention_backend="torch")
    yield llm
    llm.engine.shutdown()
    del llm
    gc.collect()


def test_the_torch_attention_backend_runs_sharded_with_the_tokens_of_one_rank(one_rank_outputs,
                                                                              torch_backend_two_ranks):
    outputs = torch_backend_two_ranks.generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False)
    worst = assert_same_tokens(one_rank_outputs[:2], outputs)
    assert worst < 1e-3


def test_a_lost_rank_fails_the_step_at_once_saying_which_and_why(torch_backend_two_ranks):
    import os
    import signal

    from pagoda.errors import StepFailedError

    llm = torch_backend_two_ranks
    try:
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
        worker = llm.engine.executor.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=30)
        with pytest.raises(StepFailedError, match=r"rank 1 \(process \d+\) exited with code -9"):
            llm.generate("Hello there", SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.engine.shutdown()
