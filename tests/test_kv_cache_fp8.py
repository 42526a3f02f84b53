"""``kv_cache_dtype="fp8"``: K/V stored as scaled float8 e4m3, read by every attention backend.

The reference for attention is plain fp32 math over the dequantized cache: every key
and value is ``float(fp8(clamp(x / scale, +-448))) * scale``, the same quantization
torch's own ``.to(torch.float8_e4m3fn)`` performs. Without a GPU the Triton kernels
run under TRITON_INTERPRET=1 on small shapes.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from one_engine import release
from serve_process import run_pagoda_here
from quant_helpers import TINY
from safetensors.torch import load_file, save_file
from tiny_models import write_tiny_checkpoint

from pagoda import LLM, SamplingParams
from pagoda.config import CacheConfig, ModelConfig
from pagoda.engine.engine_args import EngineArgs
from pagoda.errors import CheckpointError, ConfigError
from pagoda.step import AttentionBatch

FP8 = torch.float8_e4m3fn
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.fixture
def build():
    """``build(*args, **kwargs)`` is ``LLM(*args, **kwargs)``; every engine a test built is shut down and freed
    when the test ends, so nothing the module built stays in the worker."""
    built: list[LLM] = []

    def make(*args, **kwargs) -> LLM:
        built.append(LLM(*args, **kwargs))
        return built[-1]

    yield make
    while built:
        release(built.pop())


@pytest.fixture(autouse=True)
def one_thread_and_triton_interpreter(monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_THREADS", "1")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


# ---- configuration ----

@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "auto", "bfloat16"])
def test_kv_cache_dtype_accepts_auto_float_names_and_fp8(name):
    assert EngineArgs.build(kv_cache_dtype=name).kv_cache_dtype == name


@pytest.mark.parametrize("name", ["fp8_e5m2", "int4", "FP8"])
def test_unsupported_kv_cache_dtype_is_refused_listing_the_accepted_values(name):
    with pytest.raises(ConfigError) as err:
        EngineArgs.build(kv_cache_dtype=name)
    message = str(err.value)
    assert "kv_cache_dtype" in message and repr(name) in message
    assert all(v in message for v in ("auto", "fp8", "fp8_e4m3", "bfloat16"))


def test_a_float_kv_cache_dtype_other_than_the_model_dtype_is_refused(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "tiny")
    with pytest.raises(ConfigError, match="differs from the model dtype float32.*fp8"):
        EngineArgs.build(model=str(path), dtype="float32", kv_cache_dtype="bfloat16").create_engine_config()


def test_cuda_backend_refuses_an_fp8_cache_naming_a_backend_that_reads_it(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "tiny")
    with pytest.raises(ConfigError, match="'cuda'.*fp8.*attention_backend='triton'"):
        LLM(str(path), load_format="dummy", kv_cache_dtype="fp8", attention_backend="cuda", swap_space=0)


def test_a_backend_that_ignores_fp8_is_refused_instead_of_storing_model_dtype_kv(tmp_path):
    from pagoda.execution.build import check_kv_cache_dtype
    from pagoda.registry.adapt import adapt_component

    config = EngineArgs.build(model=str(write_tiny_checkpoint(tmp_path / "tiny")), dtype="bfloat16",
                              kv_cache_dtype="fp8").create_engine_config()
    # declares neither kv_cache_dtype (optional: it stores the model dtype) nor name, and is built as pagoda builds
    # every backend
    unaware = adapt_component(SimpleNamespace(), "pagoda_attention_backends", "third-party")
    assert unaware.kv_cache_dtype is None and unaware.name == "third-party" and unaware.isa_paths() == {}
    with pytest.raises(ConfigError, match="'third-party' attention backend stores K/V as bfloat16.*'cpu'"):
        check_kv_cache_dtype(config, unaware)


# ---- memory ----

@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fp8_cache_holds_twice_the_blocks_of_bf16_in_the_same_bytes(backend, tmp_path, build):
    path = write_tiny_checkpoint(tmp_path / "tiny")
    common = dict(load_format="dummy", dtype="bfloat16", kv_cache_memory_bytes=4 << 20, swap_space=0,
                  attention_backend=backend)
    bf16 = build(str(path), **common).engine
    fp8 = build(str(path), kv_cache_dtype="fp8", **common).engine
    assert bf16.num_blocks > 0 and fp8.num_blocks == 2 * bf16.num_blocks
    assert {c.dtype for c in fp8.runner.kv_caches} == {FP8}
    assert sum(c.nbytes for c in fp8.runner.kv_caches) == sum(c.nbytes for c in bf16.runner.kv_caches)


# ---- the Triton kernels' fp8 conversions ----

def test_triton_fp8_conversions_match_torch_bit_for_bit():
    import triton
    import triton.language as tl

    from pagoda.plugins.attention.triton_backend import kernel_modules

    global triton_common  # a Triton kernel resolves the names it calls among its module's globals
    kernel_modules()  # (re)defines the shared helpers in this process's Triton mode
    from pagoda.plugins.attention import triton_common

    @triton.jit
    def convert(x_ptr, codes_ptr, table_ptr, n, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(x_ptr + i, mask=i < n)
        tl.store(codes_ptr + i, triton_common.float_to_fp8e4m3(x), mask=i < n)
        j = tl.arange(0, 256)
        tl.store(table_ptr + j, triton_common.fp8e4m3_to_float(j.to(tl.uint8)))

    gen = torch.Generator().manual_seed(0)
    edges = [0.0, -0.0, 448.0, -448.0, 464.0, 1e6, 2 ** -6, 2 ** -6 * 0.99, 2 ** -10, 1.5 * 2 ** -9, 2.5 * 2 ** -9,
             -1e-4, 17.0, 18.0, 19.0]  # saturation, subnormals, exact ties (17, 19: round to even)
    x = torch.cat([torch.randn(1500, generator=gen) * s for s in (0.005, 1.0, 30.0, 600.0)] + [torch.tensor(edges)])
    codes = torch.empty(len(x), dtype=torch.uint8, device=_triton_device())
    table = torch.empty(256, device=_triton_device())
    convert[(1,)](x.to(codes.device), codes, table, len(x), N=triton.next_power_of_2(len(x)))
    expected = x.clamp(-448, 448).to(FP8).view(torch.uint8)
    assert torch.equal(codes.cpu(), expected)
    finite = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    keep = ~finite.isnan()  # codes 0x7f / 0xff (NaN) are never written: writes saturate at +-448
    assert torch.equal(table.cpu()[keep], finite[keep])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_torch_backends_fp8_widening_equals_torch_casts_for_every_code(dtype):
    from pagoda.plugins.attention.kv_fp8 import widen_fp8

    codes = torch.arange(256, dtype=torch.uint8).view(FP8).reshape(4, 64)
    finite = ~codes.float().isnan()  # NaN codes are never written: writes saturate
    assert torch.equal(widen_fp8(codes, dtype)[finite], codes.to(dtype)[finite])


def _triton_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---- every backend against fp32 attention over the dequantized cache ----

@dataclass
class Case:
    backend: str
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    requests: list[tuple[int, int]]  # (tokens cached by step 1, new tokens in step 2); decodes (1) first
    k_scale: float
    v_scale: float
    magnitude: float = 1.0  # K/V standard deviation


CASES = {
    "torch-bf16-odd-sizes": Case("torch", torch.bfloat16, 6, 2, 80, 16, [(37, 1), (18, 1), (0, 23), (50, 7)],
                                 0.04, 0.02),
    "torch-fp32-unit-scales": Case("torch", torch.float32, 4, 4, 40, 8, [(9, 1), (0, 5), (21, 3)], 1.0, 1.0),
    "cpu-bf16-odd-sizes": Case("cpu", torch.bfloat16, 6, 2, 80, 16, [(37, 1), (18, 1), (0, 23), (50, 7)],
                               0.04, 0.02),
    "cpu-fp16": Case("cpu", torch.float16, 9, 3, 64, 16, [(33, 1), (0, 17), (5, 11)], 0.5, 0.25),
    "cpu-fp32-saturating": Case("cpu", torch.float32, 4, 2, 48, 8, [(19, 1), (0, 9), (12, 6)], 0.005, 0.004,
                                magnitude=3.0),
    # bf16 model, head_dim % 32 == 0, block_size % 16 == 0: the kernel's AVX-512 BF16 path where built
    "cpu-bf16-simd-path": Case("cpu", torch.bfloat16, 9, 3, 64, 16, [(37, 1), (18, 1), (0, 23), (50, 7)], 0.04, 0.02),
    "cpu-bf16-simd-path-d96-saturating": Case("cpu", torch.bfloat16, 4, 2, 96, 32, [(40, 1), (5, 9)], 0.005, 0.004,
                                              magnitude=3.0),
    # more than 16 decodes on one thread: an fp8 cache still takes the kernel (never the batched gather)
    "cpu-bf16-many-decodes": Case("cpu", torch.bfloat16, 4, 2, 32, 8, [(c, 1) for c in range(3, 60, 3)], 0.03, 0.05),
    "triton-fp32-odd-sizes": Case("triton", torch.float32, 6, 2, 40, 8, [(21, 1), (0, 9), (13, 5)], 0.04, 0.02),
    "triton-bf16-saturating": Case("triton", torch.bfloat16, 4, 2, 32, 16, [(17, 1), (6, 7)], 0.005, 0.004,
                                   magnitude=3.0),
}


def dequantized(x: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 values a reader of the fp8 cache sees: float(fp8(clamp(x / scale))) * scale."""
    return (x.float() / scale).clamp(-448, 448).to(FP8).float() * scale


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
    """fp32 causal attention; q: [n, H, D] at positions first_pos.., k, v: [seq, Hkv, D] dequantized."""
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [seq, H, D]
    scores = torch.einsum("nhd,shd->hns", q.float(), keys) * scale
    pos = torch.arange(first_pos, first_pos + q.shape[0])
    scores.masked_fill_(torch.arange(k.shape[0])[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("hns,shd->nhd", torch.softmax(scores, -1), values)


def make_backend(case: Case):
    from pagoda.plugins.attention import pagoda_attention_backends

    mc = ModelConfig(model="", tokenizer="", served_model_name="t", hf_config={}, architecture="LlamaForCausalLM",
                     dtype=case.dtype, max_model_len=4096, seed=0, load_format="dummy", quantization=None,
                     quant_config=None, chat_template=None, vocab_size=128, hidden_size=case.num_heads * case.head_dim,
                     num_layers=1, num_heads=case.num_heads, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim)
    cc = CacheConfig(block_size=case.block_size, kv_cache_memory_bytes=1 << 20, kv_cache_dtype="fp8",
                     enable_prefix_caching=False, num_gpu_blocks_override=None, swap_space_bytes=0,
                     preemption_mode="recompute", kv_allocator="paged")
    return pagoda_attention_backends()[case.backend](mc, cc)


def batch_of(items: list[tuple[int, int, int]], tables: list[list[int]], block_size: int) -> AttentionBatch:
    """items: (request, first new position, new tokens), decodes first."""
    qsl, slots = [0], []
    for r, s, n in items:
        qsl.append(qsl[-1] + n)
        slots += [tables[r][p // block_size] * block_size + p % block_size for p in range(s, s + n)]
    seq_lens = [s + n for _, s, n in items]
    max_blocks = max(len(tables[r]) for r, _, _ in items)
    block_tables = torch.zeros(len(items), max_blocks, dtype=torch.int32)
    for row, (r, _, _) in enumerate(items):
        block_tables[row, :len(tables[r])] = torch.tensor(tables[r], dtype=torch.int32)
    return AttentionBatch(
        num_reqs=len(items), num_decodes=sum(1 for _, _, n in items if n == 1), num_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables, slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_list=qsl,
        seq_lens_list=seq_lens, max_query_len=max(n for _, _, n in items), max_seq_len=max(seq_lens),
        block_size=block_size)


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_attention_equals_fp32_attention_over_the_dequantized_cache(name):
    case = CASES[name]
    backend = make_backend(case)
    device = getattr(backend, "device", torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    bs = case.block_size
    seq_lens = [c + n for c, n in case.requests]
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 2
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for s in seq_lens:
        tables.append(pool[:-(-s // bs)])
        pool = pool[-(-s // bs):]
    kv_cache = torch.zeros(backend.kv_cache_shape(num_blocks), dtype=backend.kv_cache_dtype, device=device)
    assert kv_cache.dtype == FP8
    layer = SimpleNamespace(scale=case.head_dim ** -0.5, k_scale=case.k_scale, v_scale=case.v_scale)

    def rnd(n: int, heads: int) -> torch.Tensor:
        return (torch.randn(n, heads, case.head_dim, generator=gen) * case.magnitude).to(case.dtype)

    qs = [rnd(s, case.num_heads) for s in seq_lens]
    ks = [rnd(s, case.num_kv_heads) for s in seq_lens]
    vs = [rnd(s, case.num_kv_heads) for s in seq_lens]
    step1 = [(r, 0, c) for r, (c, _) in enumerate(case.requests) if c > 0]  # the context, as fresh prompts
    step2 = [(r, c, n) for r, (c, n) in enumerate(case.requests)]  # decodes, fresh prompts and chunks after context
    for items in (step1, step2):
        if not items:
            continue
        md = backend.build_metadata(batch_of(items, tables, bs))
        pick = lambda xs: torch.cat([xs[r][s:s + n] for r, s, n in items]).to(device)  # noqa: E731
        out = backend.forward(layer, pick(qs), pick(ks), pick(vs), kv_cache, md).cpu()
        assert out.dtype == case.dtype
        out = out.view(-1, case.num_heads, case.head_dim).float()
        expected = torch.cat([
            reference(qs[r][s:s + n], dequantized(ks[r][:s + n], case.k_scale),
                      dequantized(vs[r][:s + n], case.v_scale), s, layer.scale) for r, s, n in items])
        atol, rtol = TOLERANCE[case.dtype]
        torch.testing.assert_close(out, expected, atol=atol * max(1.0, case.magnitude), rtol=rtol)


# ---- checkpoint scales ----

def checkpoint_with_scales(tmp_path, scales: dict[str, torch.Tensor]):
    """The tiny random Llama (2 layers, real safetensors) plus extra scale tensors."""
    out = tmp_path / "tiny-scaled"
    shutil.copytree(TINY, out)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({**tensors, **scales}, str(out / "model.safetensors"))
    return out


def test_k_and_v_scales_load_from_the_checkpoint_and_scale_what_the_cache_stores(tmp_path, build):
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor(0.05), "model.layers.0.self_attn.v_scale":
              torch.tensor([0.02]), "model.layers.1.self_attn.kv_scale": torch.tensor(0.03)}
    path = checkpoint_with_scales(tmp_path, scales)
    llm = build(str(path), dtype="float32", kv_cache_dtype="fp8", attention_backend="torch", swap_space=0,
                kv_cache_memory_bytes=1 << 20)
    attns = [layer.attn for layer in llm.engine.model.layers]
    assert [s for a in attns for s in (a.k_scale, a.v_scale)] == pytest.approx([0.05, 0.02, 0.03, 0.03])

    seen = {}  # layer -> this step's K, V as the model produced them
    backend = llm.engine.backend
    forward = backend.forward

    def recording(layer, q, k, v, kv_cache, md):
        seen[layer.layer_idx] = (k.clone(), v.clone(), md.slot_mapping.clone())
        return forward(layer, q, k, v, kv_cache, md)

    backend.forward = recording
    llm.generate([{"prompt_token_ids": [1, 5, 9, 100, 200, 7, 8]}], SamplingParams(max_tokens=1, temperature=0),
                 use_tqdm=False)
    for idx, attn in enumerate(attns):
        k, v, slots = seen[idx]
        cache = llm.engine.runner.kv_caches[idx]  # [2, Hkv, num_blocks, bs, D]
        hkv, d = cache.shape[1], cache.shape[-1]
        stored_k = cache[0].reshape(hkv, -1, d)[:, slots].transpose(0, 1)  # [T, Hkv, D] fp8
        stored_v = cache[1].reshape(hkv, -1, d)[:, slots].transpose(0, 1)
        assert torch.equal(stored_k.view(torch.uint8), (k / attn.k_scale).clamp(-448, 448).to(FP8).view(torch.uint8))
        assert torch.equal(stored_v.view(torch.uint8), (v / attn.v_scale).clamp(-448, 448).to(FP8).view(torch.uint8))


def test_a_checkpoint_without_scales_loads_with_unit_scales_and_bf16_kv_ignores_scales(tmp_path, build):
    plain = build(str(TINY), dtype="float32", kv_cache_dtype="fp8", swap_space=0, kv_cache_memory_bytes=1 << 20)
    assert {(layer.attn.k_scale, layer.attn.v_scale) for layer in plain.engine.model.layers} == {(1.0, 1.0)}
    path = checkpoint_with_scales(tmp_path, {"model.layers.0.self_attn.k_scale": torch.tensor(0.05)})
    prompts = [{"prompt_token_ids": [1, 5, 9, 100, 200]}]
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0, ignore_eos=True)
    tokens = [build(str(p), dtype="float32", swap_space=0, kv_cache_memory_bytes=1 << 20).generate(
        prompts, params, use_tqdm=False)[0].outputs[0].token_ids for p in (TINY, path)]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("bad", [torch.tensor([0.1, 0.2]), torch.tensor(0.0), torch.tensor(float("nan"))],
                         ids=["two-values", "zero", "nan"])
def test_a_malformed_kv_scale_is_refused_naming_the_tensor(bad, tmp_path):
    path = checkpoint_with_scales(tmp_path, {"model.layers.1.self_attn.v_scale": bad})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.v_scale'.*one positive finite"):
        LLM(str(path), dtype="float32", kv_cache_dtype="fp8", swap_space=0, kv_cache_memory_bytes=1 << 20)


def test_a_kv_scale_for_a_layer_the_model_lacks_is_refused(tmp_path):
    path = checkpoint_with_scales(tmp_path, {"model.layers.7.self_attn.k_scale": torch.tensor(0.1)})
    with pytest.raises(CheckpointError, match=r"layers\.7.*names layer 7.*2 layers"):
        LLM(str(path), dtype="float32", kv_cache_dtype="fp8", swap_space=0, kv_cache_memory_bytes=1 << 20)


# ---- block moves and a draft model's own cache ----

TINY_PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((30, 45, 21, 38, 50))]
TINY_PARAMS = SamplingParams(max_tokens=14, min_tokens=14, temperature=0, ignore_eos=True)


def tiny_fp8_tokens(build, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = build(str(TINY), dtype="float32", kv_cache_dtype="fp8", max_model_len=256, **kwargs)
    schedule, llm.swapped_out = llm.engine.scheduler.schedule, []

    def recording_schedule():
        sched = schedule()
        llm.swapped_out.extend(sched.blocks_to_swap_out)
        return sched

    llm.engine.scheduler.schedule = recording_schedule
    outs = llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], TINY_PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def test_fp8_blocks_swapped_out_and_back_resume_with_identical_tokens(build):
    roomy, _ = tiny_fp8_tokens(build, swap_space=0, kv_cache_memory_bytes=1 << 20)
    tokens, llm = tiny_fp8_tokens(build, num_gpu_blocks_override=10, preemption_mode="swap", swap_space=0.01)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.swapped_out
    assert {c.dtype for c in llm.engine.runner.swap_caches} == {FP8}
    assert tokens == roomy


def test_a_draft_checkpoint_keeps_its_own_fp8_cache_and_greedy_tokens_stay_the_targets(build):
    plain, _ = tiny_fp8_tokens(build, swap_space=0, kv_cache_memory_bytes=1 << 20)
    spec = {"method": "draft_model", "model": str(TINY), "num_speculative_tokens": 3}
    tokens, llm = tiny_fp8_tokens(build, swap_space=0, kv_cache_memory_bytes=1 << 20, speculative_config=spec)
    assert {c.dtype for c in llm.engine.runner.draft_kv_caches} == {FP8}
    assert tokens == plain


# ---- end to end on the default model ----

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Explain photosynthesis in simple terms:",
           "Once upon a time in a land far away, there lived a", "The three primary colors are", "import numpy as np\n"]
NUM_TOKENS = 24


# nats: where fp8-KV's top choice is not bf16-KV's token, the two lie at most this far apart in fp8-KV's own
# logprobs (measured on an AVX2-only AMD EPYC: 0.875 at worst, 139 of 144 positions agreeing; a broken fp8
# cache prefers other tokens by many nats)
FP8_NEAR_TIE = 1.5


def test_default_model_with_fp8_kv_picks_bf16_kv_greedy_tokens(build):
    """Free-running greedy runs part at the first near-tie (bf16 logits tie often, and where depends on the
    CPU's rounding), so agreement is judged teacher-forced: on bf16-KV's greedy sequence, fp8-KV's argmax at
    every generated position, which must be bf16-KV's token or lie within ``FP8_NEAR_TIE`` of it.
    """
    params = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    common = dict(dtype="bfloat16", swap_space=0, kv_cache_memory_bytes=32 << 20)
    bf16_llm = LLM(**common)
    try:
        bf16_runs = bf16_llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        release(bf16_llm)  # one copy of the default model at a time
        del bf16_llm
    bf16 = [list(o.outputs[0].token_ids) for o in bf16_runs]
    fp8_llm = build(kv_cache_dtype="fp8", enable_prefix_caching=False, **common)
    forced = fp8_llm.generate([{"prompt_token_ids": list(o.prompt_token_ids) + t} for o, t in zip(bf16_runs, bf16)],
                              SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    agree, gaps = 0, []
    for o, tokens, out in zip(bf16_runs, bf16, forced):
        n = len(o.prompt_token_ids)
        for j, token in enumerate(tokens):
            ranked = out.prompt_logprobs[n + j]  # the token at position n + j and fp8's top-1 there
            top = max(ranked, key=lambda t: ranked[t].logprob)
            agree += top == token
            gaps.append(ranked[top].logprob - ranked[token].logprob)
    total = NUM_TOKENS * len(PROMPTS)
    assert max(gaps) <= FP8_NEAR_TIE, (f"fp8 KV prefers another token by {max(gaps):.3f} nats "
                                       f"(allowed {FP8_NEAR_TIE}); {agree} of {total} positions agree")


def test_default_model_fp8_kv_values_fit_e4m3_without_a_scale(build):
    """Unit scales are the default because this model's K/V stay far inside e4m3's +-448."""
    llm = build(dtype="bfloat16", attention_backend="torch", swap_space=0, kv_cache_memory_bytes=32 << 20)
    backend, peaks = llm.engine.backend, [0.0, 0.0]
    forward = backend.forward

    def recording(layer, q, k, v, kv_cache, md):
        peaks[0], peaks[1] = max(peaks[0], k.abs().max().item()), max(peaks[1], v.abs().max().item())
        return forward(layer, q, k, v, kv_cache, md)

    backend.forward = recording
    llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    # measured: max |K| 19.9, max |V| 13.0 over these prompts and all 30 layers
    assert 1.0 < peaks[0] < 448 / 8 and 1.0 < peaks[1] < 448 / 8, peaks


# ---- the command line ----

@pytest.mark.slow
def test_pagoda_generate_and_bench_latency_take_kv_cache_dtype_fp8(capsys):
    # by the console script's entry point in this process (a process start costs seconds of imports; the
    # commands' own processes run in test_cli.py)
    result = run_pagoda_here(capsys, "generate", "The capital of France is", "--max-tokens", "8", "--dtype",
                             "float32", "--kv-cache-space", "0.05", "--kv-cache-dtype", "fp8")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    result = run_pagoda_here(capsys, "bench", "latency", "--no-baseline", "--prompt-len", "16", "--output-len", "4",
                             "--repeats", "1", "--kv-cache-space", "0.05", "--kv-cache-dtype", "fp8")
    assert result.returncode == 0, result.stderr
    header = result.stdout.splitlines()[0]
    assert "KV blocks:" in header and "(float8_e4m3fn)" in header, header


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_pagoda_commands_refuse_an_unsupported_kv_cache_dtype_without_a_traceback(command, capsys):
    # the console script's entry point in this process (an exception escaping it would fail the test): the
    # refusal comes before any model is loaded, so a process start would cost more than the check
    result = run_pagoda_here(capsys, *command, "--kv-cache-dtype", "fp8_e5m2")
    assert result.returncode != 0
    assert "kv_cache_dtype" in result.stderr and "fp8_e4m3" in result.stderr
    assert "Traceback" not in result.stderr
