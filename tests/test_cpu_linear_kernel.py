"""The ``cpu_linear_kernel`` host setting: the default mode's bf16 linears through oneDNN's packed GEMM (the GEMV and
widened-tile GEMM on AVX2) or pagoda's packed GEMM (``invariant_gemm.cpp``). Through the packed GEMM a linear
layer and the tied LM head hold one packed copy of their weights and match an fp32 matmul within bf16 rounding on
odd shapes; LoRA adapters add their terms on top of the packed base weights; a value it does not know is refused
naming the values it takes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.engine.engine_args import EngineArgs
from pagoda.errors import ConfigError
from pagoda.host.cpu_isa import cpu_isa
from pagoda.host.env import resolve_host_config
from pagoda.modeling.layers import fused_ops, onednn
from pagoda.modeling.layers.fused_ops import CpuKernels
from pagoda.modeling.layers.linear import Linear, Logits
from lora_helpers import make_adapter
from tiny_models import write_tiny_llama


def kernels_with(choice: str, **settings) -> CpuKernels:
    return CpuKernels(dataclasses.replace(resolve_host_config(), cpu_linear_kernel=choice, **settings))


@pytest.fixture(scope="module")
def packed() -> CpuKernels:
    found = kernels_with("packed")
    if found.packed_gemm_ops is None:
        pytest.skip("this build has no packed bf16 GEMM (neither AVX-512 BF16 nor AVX2 + FMA)")
    return found


@pytest.mark.parametrize("in_features,output_sizes,bias", [(203, [17, 20], True), (37, [50], False),
                                                          (1, [29], True), (576, [96, 33], True)])
def test_a_packed_linear_layer_matches_an_fp32_matmul_holding_one_packed_weight(packed, in_features, output_sizes,
                                                                              bias):
    gen = torch.Generator().manual_seed(in_features)
    out_features = sum(output_sizes)
    layer = Linear(in_features, output_sizes, bias=bias, dtype=torch.bfloat16, kernels=packed)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    layer.weight.data.copy_(w)
    if bias:
        layer.bias.data.copy_(b)
    layer.process_weights_after_loading()
    # one copy of the weight, in the packed GEMM's layout
    assert layer.packed and not layer.weight.is_mkldnn
    assert tuple(layer.weight.shape) == (out_features, (in_features + 1) // 2, 2)
    for shape in [(1, in_features), (5, in_features), (3, 11, in_features)]:
        x = torch.randn(*shape, generator=gen).bfloat16()
        got = layer(x)
        reference = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        assert got.dtype == torch.bfloat16 and got.shape == (*shape[:-1], out_features)
        torch.testing.assert_close(got.float(), reference, rtol=1.6e-2,
                                   atol=1e-2 * max(1.0, reference.abs().max().item()))


def test_the_tied_lm_head_goes_through_the_packed_gemm_and_the_embedding_stays_plain(packed):
    gen = torch.Generator().manual_seed(5)
    embedding = torch.nn.Embedding(77, 45, dtype=torch.bfloat16)
    head = Logits(77, packed)
    assert tuple(head.packed_tied(embedding).shape) == (77, 23, 2)
    hidden = torch.randn(3, 45, generator=gen).bfloat16()
    got = head(hidden, None, embedding)
    reference = hidden.float() @ embedding.weight.float().t()
    torch.testing.assert_close(got, reference, rtol=1.6e-2, atol=1e-2 * max(1.0, reference.abs().max().item()))
    assert embedding.weight.shape == (77, 45)


def test_the_setting_picks_the_kernel_and_auto_follows_the_isa_level(packed):
    assert packed.uses_packed_gemm and not packed.batch_invariant
    assert packed.isa_paths(torch.bfloat16)["dense linear"].startswith("packed bf16 GEMM")
    chosen = kernels_with("onednn")
    assert chosen.packed_gemm_ops is None and not chosen.uses_packed_gemm
    assert "packed bf16 GEMM" not in chosen.isa_paths(torch.bfloat16)["dense linear"]
    weight = torch.randn(24, 16).bfloat16()
    if onednn.packing_available(resolve_host_config()):
        assert chosen.pack_weight(weight).is_mkldnn
    host = resolve_host_config()
    for level in ("avx2", "avx512_bf16"):
        capped = dataclasses.replace(host, cpu_linear_kernel="auto", cpu_isa=level)
        expected = "packed" if cpu_isa(level) in fused_ops.PACKED_GEMM_AUTO_ISAS else "onednn"
        assert fused_ops.linear_kernel(capped) == expected
    # without the compiled kernels the default mode keeps torch's path
    off = kernels_with("packed", fused_cpu_ops=False)
    assert off.packed_gemm_ops is None and not off.uses_packed_gemm


def test_a_bad_value_is_refused_naming_the_values_it_takes(monkeypatch):
    with pytest.raises(Exception, match="auto.*onednn.*packed"):
        EngineArgs(cpu_linear_kernel="fast")
    monkeypatch.setenv("PAGODA_CPU_LINEAR_KERNEL", "fast")
    with pytest.raises(ConfigError, match="PAGODA_CPU_LINEAR_KERNEL='fast' is not one of auto, onednn, packed"):
        EngineArgs().host_config()
    monkeypatch.setenv("PAGODA_CPU_LINEAR_KERNEL", "Packed")
    assert EngineArgs().host_config().cpu_linear_kernel == "packed"


def test_lora_adds_its_terms_on_top_of_packed_base_weights(packed, tmp_path):
    (tmp_path / "tiny").mkdir()
    model_dir = write_tiny_llama(tmp_path / "tiny", seed=7)
    adapter = make_adapter(model_dir, tmp_path / "adapter", seed=4, r=8, alpha=16)
    prompt = {"prompt_token_ids": [5, 17, 923, 4001, 77, 300, 12]}
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    lora = LoRARequest("tiny", 1, str(adapter))
    logprobs = {}
    for choice in ("packed", "onednn"):
        llm = LLM(str(model_dir), dtype="bfloat16", enable_lora=True, max_lora_rank=8, cpu_threads=1,
                  kv_cache_memory_bytes=8 << 20, cpu_linear_kernel=choice)
        linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear) and m.lora is not None]
        assert linears and all((m.packed and not m.weight.is_mkldnn) == (choice == "packed") for m in linears)
        for name, request in (("base", None), ("adapter", lora)):
            out = llm.generate([prompt], params, use_tqdm=False, lora_request=[request])[0].outputs[0]
            logprobs[choice, name] = {k: v.logprob for k, v in out.logprobs[0].items()}
        del llm
    # the adapter's term is there on the packed weights: the adapter moves the logprobs far more than the kernels do
    for name in ("base", "adapter"):
        shared = set(logprobs["packed", name]) & set(logprobs["onednn", name])
        assert shared and max(abs(logprobs["packed", name][t] - logprobs["onednn", name][t]) for t in shared) < 0.1
    base, adapted = logprobs["packed", "base"], logprobs["packed", "adapter"]
    assert set(base) != set(adapted) or max(abs(base[t] - adapted[t]) for t in base) > 0.3
