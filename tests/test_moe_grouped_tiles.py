"""The CPU MoE kernel's grouped tiles (every expert's tokens against each chunk of its weights) against a
float64 per-token loop, at the sizes where they differ from the decode GEMV: many tokens per expert, odd
hidden and intermediate sizes, experts with no tokens, top-1 and top-8."""

import pytest
import torch

from pagoda.host.cpp_extension import load_cpu_extension
from pagoda.host.env import resolve_host_config
from pagoda.host.cpu_isa import cpu_isa
from pagoda.modeling.layers.moe import _SOURCE, FusedMoE, RouterSpec, select_experts
from tests.test_moe_layer import reference


@pytest.fixture(scope="module")
def ops():
    return load_cpu_extension("pagoda_moe_ops", _SOURCE, host=resolve_host_config())


def routed_case(tokens, hidden, inter, experts, top_k, dtype, seed, idle=()):
    """A random layer whose router never picks the experts in ``idle``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, list(idle)] = -1e9
    weights, ids = select_experts(logits, RouterSpec(top_k))
    return x, w13, w2, weights, ids


# (tokens, hidden, inter, experts, top_k, idle experts): top-8 of 9 with 37 tokens (4-token blocks and the
# 2- and 1-token tails per expert), odd hidden, intermediate not a multiple of the row blocks, top-1
CASES = [(37, 45, 19, 9, 8, ()), (13, 33, 7, 5, 1, (1, 3)), (66, 24, 13, 3, 1, (2,)), (5, 17, 11, 12, 8, (0, 5))]


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype,bf16_dot", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_grouped_tiles_equal_the_float64_loop(ops, case, dtype, bf16_dot, lanes):
    *shape, idle = case
    x, w13, w2, weights, ids = routed_case(*shape, dtype, seed=len(idle) + shape[0], idle=idle)
    assert not set(idle) & set(ids.view(-1).tolist())
    ref = reference(x, w13, w2, weights, ids)
    got = ops.moe_experts(x, w13, w2, None, None, None, None, ids, weights, 0, 1.702, 7.0, lanes, bf16_dot)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.double(), ref, **tol)


def test_grouped_tiles_int8_with_biases_and_clamped_swiglu(ops):
    x, w13, w2, weights, ids = routed_case(23, 31, 9, 4, 2, torch.float32, seed=7, idle=(3,))
    s13, s2 = w13.abs().amax(-1) / 127, w2.abs().amax(-1) / 127
    q13, q2 = torch.round(w13 / s13[..., None]).to(torch.int8), torch.round(w2 / s2[..., None]).to(torch.int8)
    b13, b2 = torch.randn(4, 18), torch.randn(4, 31)
    x = x * 4  # past the clamp
    ref = reference(x, q13.float() * s13[..., None], q2.float() * s2[..., None], weights, ids, "clamped_swiglu", b13,
                    b2)
    got = ops.moe_experts(x, q13, q2, s13.contiguous(), s2.contiguous(), b13, b2, ids, weights, 1, 1.702, 7.0,
                          0, False)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def test_the_layer_takes_bf16_dot_products_only_for_bf16_experts_on_a_cpu_with_bf16_math():
    host = resolve_host_config()
    bf16 = FusedMoE(4, 16, 8, torch.bfloat16, host=host)
    assert bf16.bf16_dot == (cpu_isa(host.cpu_isa) == "avx512_bf16")
    assert ("bf16 dot products" in bf16.isa_path()) == (bf16.bf16_dot and bf16.ops.moe_path() == "avx512_bf16")
    layer = FusedMoE(4, 16, 8, torch.float32, host=host)
    assert not layer.bf16_dot and "weights widened to fp32" in layer.isa_path()
    torch.manual_seed(0)
    layer.w13.data.normal_(0, 0.2)
    layer.w2.data.normal_(0, 0.2)
    x = torch.randn(40, 16)
    weights, ids = select_experts(torch.randn(40, 4), RouterSpec(2))
    torch.testing.assert_close(layer(x, weights, ids).double(), reference(x, layer.w13, layer.w2, weights, ids),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bf16_dot", [False, True])
def test_decode_output_is_the_same_on_one_thread_and_on_several(ops, bf16_dot):
    # the down projection's column tiles sum each token's experts in ascending order whatever thread runs them
    x, w13, w2, weights, ids = routed_case(16, 100, 36, 9, 3, torch.bfloat16, seed=7)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(ops.moe_experts(x, w13, w2, None, None, None, None, ids, weights, 0, 1.702, 7.0,
                                           0, bf16_dot))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    torch.testing.assert_close(results[0].double(), reference(x, w13, w2, weights, ids), rtol=2e-2, atol=2e-2)
