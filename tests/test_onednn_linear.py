"""bf16 weights packed for oneDNN multiply exactly as ``F.linear`` does, in the layer and in the whole model
(``cpu_linear_kernel=onednn``)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pagoda.engine.llm import LLM
from pagoda.host import cpu_isa
from pagoda.host.env import resolve_host_config
from pagoda.modeling.layers import onednn
from pagoda.modeling.layers.fused_ops import CpuKernels
from pagoda.modeling.layers.linear import Linear
from pagoda.plugins.quant.memory import weight_memory
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not onednn.packing_available(resolve_host_config()),
                                reason="oneDNN packs bf16 weights on AVX-512 CPUs; "
                                f"this CPU runs {cpu_isa.describe()}")


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 64, 333])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (49, 40), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(rows, out_features, in_features, with_bias):
    g = torch.Generator().manual_seed(rows * out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g).to(torch.bfloat16) if with_bias else None
    packed = onednn.pack_weight(w)
    assert packed is not None and onednn.is_packed(packed)
    assert torch.equal(onednn.packed_linear(x, packed, b), F.linear(x, w, b))
    assert torch.equal(onednn.dense(packed), w)


def test_packed_linear_takes_leading_dims_and_strided_rows():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    packed = onednn.pack_weight(w)
    x3 = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(onednn.packed_linear(x3, packed), F.linear(x3, w))
    wide = torch.randn(7, 128, generator=g).to(torch.bfloat16)[:, :64]  # rows 128 apart
    assert torch.equal(onednn.packed_linear(wide, packed), F.linear(wide, w))
    assert onednn.packed_linear(torch.empty(0, 64, dtype=torch.bfloat16), packed).shape == (0, 96)


def test_only_bf16_cpu_weights_are_packed():
    assert onednn.pack_weight(torch.randn(8, 8)) is None  # float32 stays on F.linear (HF parity)
    assert onednn.pack_weight(torch.randn(8, 8, dtype=torch.float16)) is None
    assert onednn.pack_weight(torch.randn(8, dtype=torch.bfloat16)) is None


def test_linear_layer_packs_once_after_loading_and_keeps_its_shape_and_values():
    g = torch.Generator().manual_seed(2)
    layer = Linear(40, [24, 8], bias=True, dtype=torch.bfloat16, kernels=CpuKernels(
        dataclasses.replace(resolve_host_config(), cpu_linear_kernel="onednn")))
    w = torch.randn(32, 40, generator=g).to(torch.bfloat16)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(32, generator=g).to(torch.bfloat16))
    x = torch.randn(9, 40, generator=g).to(torch.bfloat16)
    plain = layer(x)
    layer.process_weights_after_loading()
    assert layer.packed and onednn.is_packed(layer.weight) and tuple(layer.weight.shape) == (32, 40)
    packed_param = layer.weight
    layer.process_weights_after_loading()  # a second call leaves it alone
    assert layer.weight is packed_param
    assert torch.equal(layer(x), plain)
    assert torch.equal(onednn.dense(layer.weight), w)


def _unpack(model) -> None:
    """Put every packed weight back as a plain matrix (the layers then run F.linear)."""
    for m in model.modules():
        if isinstance(m, Linear) and onednn.is_packed(m.weight):
            m.weight = torch.nn.Parameter(onednn.dense(m.weight), requires_grad=False)
            m.packed = False
    model._logits.packed_tied = lambda embedding: None  # the tied LM head falls back to the plain embedding


def test_default_model_in_bf16_gives_the_same_tokens_and_logprobs_packed_and_plain():
    llm = LLM(dtype="bfloat16", cpu_threads=1, kv_cache_memory_bytes=64 << 20, cpu_linear_kernel="onednn")
    model = llm.engine.model
    packed = [m for m in model.modules() if isinstance(m, Linear) and onednn.is_packed(m.weight)]
    assert len(packed) == 4 * len(model.layers)
    assert model._logits.packed_tied(model.embed_tokens) is not None  # the tied LM head is packed
    memory = weight_memory(model)
    assert memory.linear_bytes == memory.linear_bf16_bytes  # a packed weight is counted at its bf16 size
    # six prompts, so the plain run's decode steps (more than 4 rows) go through F.linear, not the GEMV kernel
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "My favourite colour is",
               "Once upon a time", "The largest planet in the solar system is"]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, ignore_eos=True, logprobs=3)
    runs = []
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, [{k: v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs])
                     for o in outs])
        _unpack(model)
    assert runs[0] == runs[1]
