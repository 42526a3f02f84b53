"""The batch-invariant mode in bf16: a request's tokens and logprobs are bit-identical alone and among others at
any position, with any step budget (chunked prefill), from a prefix-cache hit or a cold prefill, after
preemption by recompute or swap, greedy and seeded; on the cpu backend's kernels and the torch reference. The engine
refuses components that do not claim the mode. Logprobs are compared as floats with ``==``, never within a
tolerance."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError
from pagoda.host.env import resolve_host_config
from pagoda.modeling.default_model import ensure_default_model
from pagoda.modeling.layers.fused_ops import CpuKernels
from one_engine import release
from tiny_models import write_tiny_llama

rng = random.Random(49)
SHARED = [rng.randrange(1000, 30000) for _ in range(40)]  # two full blocks and a half, shared by two prompts
TARGET = SHARED + [rng.randrange(1000, 30000) for _ in range(9)]
OTHERS = [[rng.randrange(1000, 30000) for _ in range(rng.randrange(3, 60))] for _ in range(5)]
OTHERS[2] = SHARED[:33] + OTHERS[2]  # another request with the same first two blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=6, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    # long enough reductions (K = 256 and 512) for their order to show in bf16's roundings
    path = tmp_path_factory.mktemp("tiny-llama-inv")
    write_tiny_llama(path, seed=3, hidden=256, heads=4, kv_heads=2, head_dim=64, inter=512, norm_noise=0.3)
    return str(path)


def make_llm(model: str, backend: str = "cpu", **options) -> LLM:
    base = dict(model=model, dtype="bfloat16", batch_invariant=True, attention_backend=backend, max_model_len=256,
                cpu_threads=2, enable_prefix_caching=False)
    return LLM(**{**base, **options})


def results(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[tuple]:
    """Per prompt: its token ids and, per position, the chosen and top logprobs (exact floats)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    found = []
    for o in outs:
        c = o.outputs[0]
        found.append((tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items()))
                                                for d in c.logprobs)))
    return found


@pytest.fixture(scope="module", params=["cpu", "torch"])
def engine(request, tiny_model) -> LLM:
    llm = make_llm(tiny_model, request.param)
    yield llm
    release(llm)  # nothing the module built stays in the worker
    del llm


@pytest.fixture(scope="module")
def alone(engine) -> dict[str, tuple]:
    return {"greedy": results(engine, [TARGET], GREEDY)[0], "seeded": results(engine, [TARGET], SEEDED)[0]}


@pytest.mark.parametrize("position", [0, 3, 5])
def test_a_request_gives_the_same_bits_alone_and_among_others_at_any_position(engine, alone, position):
    prompts = OTHERS[:position] + [TARGET] + OTHERS[position:]
    assert results(engine, prompts, GREEDY)[position] == alone["greedy"]


def test_a_seeded_request_samples_the_same_tokens_and_logprobs_among_others(engine, alone):
    outs = engine.generate([{"prompt_token_ids": p} for p in OTHERS[:2] + [TARGET]],
                           [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)] * 2 + [SEEDED],
                           use_tqdm=False)
    c = outs[2].outputs[0]
    got = (tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items())) for d in c.logprobs))
    assert got == alone["seeded"]


@pytest.mark.parametrize("budget", [8, 24])
def test_chunked_prefill_of_any_step_budget_gives_the_same_bits(tiny_model, engine, alone, budget):
    backend = engine.engine.config.attention_backend
    chunked = make_llm(tiny_model, backend, max_num_batched_tokens=budget, max_num_seqs=4)
    got = results(chunked, OTHERS[:3] + [TARGET], GREEDY)
    assert got[3] == alone["greedy"]


def test_a_prefix_cache_hit_gives_the_same_bits_as_a_cold_prefill(tiny_model, engine, alone):
    backend = engine.engine.config.attention_backend
    cached = make_llm(tiny_model, backend, enable_prefix_caching=True)
    stats = cached.engine.kv_manager.stats
    assert results(cached, [OTHERS[2]], GREEDY)  # caches the two blocks TARGET shares with it
    hits = stats.hits
    assert results(cached, [TARGET], GREEDY)[0] == alone["greedy"]
    assert stats.hits - hits == 32
    assert results(cached, [TARGET, OTHERS[0]], GREEDY)[0] == alone["greedy"]  # all three of its full blocks hit
    assert stats.hits - hits == 32 + 48


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_preempted_request_gives_the_same_bits(tiny_model, engine, alone, preemption_mode):
    backend = engine.engine.config.attention_backend
    # 8 blocks of 16 tokens: two 31-token prompts (2 blocks each, a third from their second token on) and TARGET
    # (4 blocks) cannot all keep their K/V while they grow; the last to arrive is preempted and recomputed
    fillers = [[rng.randrange(1000, 30000) for _ in range(31)] for _ in range(2)]
    small = make_llm(tiny_model, backend, num_gpu_blocks_override=8, max_num_seqs=3, preemption_mode=preemption_mode,
                     swap_space=0.01)
    kv = small.engine.scheduler.kv
    swapped, swap_out = [], kv.swap_out
    kv.swap_out = lambda request: swapped.append(request.request_id) or swap_out(request)
    got = results(small, fillers + [TARGET], GREEDY)
    assert small.engine.scheduler.num_preemptions > 0
    assert bool(swapped) == (preemption_mode == "swap")
    assert got[2] == alone["greedy"]


def test_the_cpu_kernels_and_the_torch_reference_agree_on_greedy_tokens(tiny_model):
    # not bit for bit (different kernels), but the same tokens on this well-separated tiny model
    cpu = results(make_llm(tiny_model, "cpu"), [TARGET], GREEDY)[0][0]
    ref = results(make_llm(tiny_model, "torch"), [TARGET], GREEDY)[0][0]
    assert cpu == ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_invariant_linears_row_has_the_same_bits_at_any_batch_size_and_position(dtype):
    kernels = CpuKernels(resolve_host_config(), batch_invariant=True)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=gen).to(dtype)
    bias = torch.randn(1536, generator=gen).to(dtype)
    x = torch.randn(70, 576, generator=gen).to(dtype)
    alone = torch.cat([kernels.linear(x[i:i + 1], w, bias) for i in range(len(x))])
    for m in (2, 9, 17, 64, 70):
        assert torch.equal(kernels.linear(x[:m], w, bias), alone[:m]), m
    shifted = kernels.linear(x.roll(5, 0), w, bias).roll(-5, 0)
    assert torch.equal(shifted, alone)


def test_the_mode_refuses_a_backend_that_does_not_claim_it_by_name(tiny_model):
    with pytest.raises(ConfigError, match="attention backend 'triton'.*batch-invariant"):
        make_llm(tiny_model, "triton")


def test_the_mode_refuses_quantized_weights_and_lora(tiny_model):
    with pytest.raises(ConfigError, match="int8-quantized"):
        make_llm(tiny_model, quantization="int8")
    with pytest.raises(ConfigError, match="LoRA"):
        make_llm(tiny_model, enable_lora=True)


def test_the_default_model_answers_a_repeated_chat_the_same_from_its_prefix_cache():
    # the chat whose second answer, a 16-token prefix-cache hit, used to part from the first in bf16
    ensure_default_model()
    llm = LLM(batch_invariant=True, dtype="bfloat16", max_model_len=256, cpu_threads=2)
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    try:
        first, second = (llm.chat(messages, params, use_tqdm=False)[0].outputs[0] for _ in range(2))
        hits = llm.engine.kv_manager.stats.hits
    finally:
        release(llm)  # a copy of the default model: not kept past its test
        del llm
    assert hits >= 16
    assert second.token_ids == first.token_ids
    assert [d[t].logprob for d, t in zip(second.logprobs, second.token_ids)] == \
        [d[t].logprob for d, t in zip(first.logprobs, first.token_ids)]


@pytest.mark.parametrize("argv", [["generate", "hello"], ["serve"], ["bench", "latency"]])
def test_the_commands_take_batch_invariant_into_their_engine_args(argv):
    from pagoda.cli import build_parser, engine_args_from

    parser = build_parser()
    assert engine_args_from(parser.parse_args(argv + ["--batch-invariant"])).batch_invariant is True
    assert engine_args_from(parser.parse_args(argv)).batch_invariant is False


def test_the_conformance_kit_checks_a_backends_claim_of_batch_invariance():
    from pagoda.plugins.attention.cpu_backend import CpuAttentionBackend
    from pagoda.plugins.attention.torch_backend import TorchAttentionBackend
    from pagoda.testing import ContractError, check_batch_invariance

    assert check_batch_invariance(CpuAttentionBackend) and check_batch_invariance(TorchAttentionBackend)

    class ClaimsWithoutTheMode(CpuAttentionBackend):
        """Says it is invariant but plans its steps as outside the mode (fresh prompts apart)."""

        def build_metadata(self, batch):
            self.batch_invariant = False
            try:
                return super().build_metadata(batch)
            finally:
                self.batch_invariant = True

    with pytest.raises(ContractError, match="claims batch_invariant"):
        check_batch_invariance(ClaimsWithoutTheMode)

    class Unclaimed(CpuAttentionBackend):
        def __init__(self, model_config, cache_config):
            super().__init__(model_config, cache_config)
            self.batch_invariant = False

    assert check_batch_invariance(Unclaimed) is False


# ---- a restore from the offload tier, a retried step, steps in flight, two tensor-parallel ranks (cpu backend) ----

@pytest.fixture(scope="module")
def cpu_alone(tiny_model) -> tuple:
    llm = make_llm(tiny_model)
    try:
        return results(llm, [TARGET], GREEDY)[0]
    finally:
        release(llm)


def test_a_restore_from_the_kv_offload_tier_gives_the_same_bits(tiny_model, cpu_alone):
    llm = make_llm(tiny_model, enable_prefix_caching=True, num_gpu_blocks_override=10, max_num_seqs=1,
                   kv_offload_ram=0.001)
    results(llm, [OTHERS[2]], GREEDY)  # its first two blocks are TARGET's
    fill = random.Random(7)
    results(llm, [[fill.randrange(1000, 30000) for _ in range(60)] for _ in range(3)], GREEDY)  # evicts them
    stats = llm.engine.kv_manager.tiers.stats
    restored = stats.ram.hits
    assert results(llm, [TARGET], GREEDY)[0] == cpu_alone
    assert stats.ram.hits - restored == 2


def test_a_retried_step_gives_the_same_bits(tiny_model, cpu_alone):
    llm = make_llm(tiny_model, max_num_seqs=4)
    calls = []

    def fail_once(module, args, output):  # the third forward pass raises mid-model, after layer 0 wrote its K/V
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")

    handle = llm.engine.model.layers[1].register_forward_hook(fail_once)
    try:
        got = results(llm, OTHERS[:3] + [TARGET], GREEDY)
    finally:
        handle.remove()
    assert len(calls) > 3 and got[3] == cpu_alone


def test_steps_in_flight_over_two_pipeline_stages_give_the_same_bits(tiny_model, cpu_alone):
    llm = make_llm(tiny_model, pipeline_parallel_size=2, pipeline_batches_in_flight=2, max_num_seqs=4,
                   kv_cache_memory_bytes=16 << 20, cpu_threads=1)
    try:
        got = results(llm, OTHERS[:3] + [TARGET] + OTHERS[3:], GREEDY)
        assert llm.engine.most_steps_in_flight == 2
    finally:
        llm.engine.shutdown()
    assert got[3] == cpu_alone


def test_two_tensor_parallel_ranks_give_a_request_the_same_bits_alone_and_among_others(tiny_model):
    # each rank's partial sums are row-invariant and the all-reduce adds the same partials: bits of their own
    # (not one rank's), the same whatever the batch
    llm = make_llm(tiny_model, tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20, cpu_threads=1)
    try:
        alone = results(llm, [TARGET], GREEDY)[0]
        assert results(llm, OTHERS[:3] + [TARGET] + OTHERS[3:], GREEDY)[3] == alone
        seeded = results(llm, [TARGET], SEEDED)[0]
        assert results(llm, OTHERS[:2] + [TARGET], [GREEDY, GREEDY, SEEDED])[2] == seeded
    finally:
        llm.engine.shutdown()
