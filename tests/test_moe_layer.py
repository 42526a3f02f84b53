"""The MoE layer: routing, the grouped torch experts and the C++ kernel against a per-token torch reference."""

import pytest
import torch
import torch.nn.functional as F

from pagoda.errors import CheckpointError, ConfigError
from pagoda.host.cpp_extension import load_cpu_extension
from pagoda.host.env import HostConfig, resolve_host_config
from pagoda.modeling.layers.moe import (_SOURCE, FusedMoE, RouterSpec, SharedExpert, SparseMoeBlock, grouped_experts,
                                        select_experts)


@pytest.fixture(scope="module")
def ops():
    """The kernel built for this CPU (a build failure fails the tests that use it)."""
    return load_cpu_extension("pagoda_moe_ops", _SOURCE, host=resolve_host_config())


def reference(x, w13, w2, weights, ids, activation="silu", b13=None, b2=None, alpha=1.702, limit=7.0,
              hidden_dtype=None):
    """Token by token, slot by slot, in float64: what every grouped path must compute (``hidden_dtype``: the
    gated hidden state rounded to it, as the bf16 dot products round it)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e].double() @ x[t].double() + (b13[e].double() if b13 is not None else 0)
            g, u = gu[:inter], gu[inter:]
            if activation == "silu":
                h = F.silu(g) * u
            else:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                h = (u + 1) * g * torch.sigmoid(alpha * g)
            if hidden_dtype is not None:
                h = h.to(hidden_dtype).double()
            y = w2[e].double() @ h + (b2[e].double() if b2 is not None else 0)
            out[t] += float(weights[t, j]) * y
    return out


def random_case(tokens, hidden, inter, experts, top_k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = select_experts(logits, RouterSpec(top_k))
    return x, w13, w2, weights, ids


# (tokens, hidden, inter, experts, top_k): decode sizes, odd sizes, one expert taking every token
SHAPES = [(1, 64, 32, 4, 2), (3, 33, 17, 5, 2), (7, 100, 52, 8, 1), (40, 72, 40, 4, 2), (1, 16, 8, 2, 2),
          (64, 48, 24, 1, 1)]


def _tolerance(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_torch_experts_equal_the_per_token_reference(shape, dtype):
    x, w13, w2, weights, ids = random_case(*shape, dtype)
    got = grouped_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), reference(x, w13, w2, weights, ids), **_tolerance(dtype))


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_reference_at_both_vector_widths(ops, shape, dtype, lanes):
    x, w13, w2, weights, ids = random_case(*shape, dtype)
    ref = reference(x, w13, w2, weights, ids)
    for bf16_dot in (False, True):  # widened weights; bf16 dot products for bf16 where the build has them
        got = ops.moe_experts(x, w13, w2, None, None, None, None, ids, weights, 0, 1.702, 7.0, lanes, bf16_dot)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), ref, **_tolerance(dtype))


def needs_bf16_dot(ops):
    if ops.moe_path() != "avx512_bf16":
        pytest.skip(f"the kernel's {ops.moe_path()} build has no bf16 dot products (AVX512_BF16)")


# k not a multiple of 32 (the masked last step), 4-, 2- and 1-token blocks per expert, an expert with no tokens
@pytest.mark.parametrize("shape", [(37, 45, 19, 9, 8), (19, 100, 52, 8, 2), (3, 1024, 512, 64, 8), (150, 64, 96, 3, 1)])
def test_kernel_bf16_dot_products_equal_the_reference_with_the_hidden_state_rounded(ops, shape):
    needs_bf16_dot(ops)
    x, w13, w2, weights, ids = random_case(*shape, torch.bfloat16, seed=shape[0])
    got = ops.moe_experts(x, w13, w2, None, None, None, None, ids, weights, 0, 1.702, 7.0, 0, True)
    # products of bf16 pairs are exact and summed in fp32: the error left is the output's bf16 rounding
    torch.testing.assert_close(got.double(), reference(x, w13, w2, weights, ids, hidden_dtype=torch.bfloat16),
                               rtol=8e-3, atol=2e-3)
    widened = ops.moe_experts(x, w13, w2, None, None, None, None, ids, weights, 0, 1.702, 7.0, 0, False)
    assert not torch.equal(got, widened)  # the flag took the other path


def test_kernel_bf16_dot_products_with_biases_and_clamped_swiglu(ops):
    needs_bf16_dot(ops)
    x, w13, w2, weights, ids = random_case(21, 40, 24, 4, 2, torch.bfloat16, seed=3)
    x = x * 4  # past the clamp limit
    b13, b2 = torch.randn(4, 48), torch.randn(4, 40)
    ref = reference(x, w13, w2, weights, ids, "clamped_swiglu", b13, b2, 1.702, 7.0, hidden_dtype=torch.bfloat16)
    got = ops.moe_experts(x, w13, w2, None, None, b13, b2, ids, weights, 1, 1.702, 7.0, 0, True)
    torch.testing.assert_close(got.double(), ref, rtol=8e-3, atol=4e-3)


@pytest.mark.parametrize("tokens", [1, 30])
def test_kernel_clamped_swiglu_with_biases_equals_the_reference(ops, tokens):
    x, w13, w2, weights, ids = random_case(tokens, 40, 24, 4, 2, torch.float32, seed=3)
    x = x * 4  # past the clamp limit
    b13, b2 = torch.randn(4, 48), torch.randn(4, 40)
    ref = reference(x, w13, w2, weights, ids, "clamped_swiglu", b13, b2, 1.702, 7.0)
    got = ops.moe_experts(x, w13, w2, None, None, b13, b2, ids, weights, 1, 1.702, 7.0, 0, False)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grouped_experts(x, w13, w2, weights, ids, "clamped_swiglu", b13, b2).double(), ref,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_kernel_int8_experts_equal_their_dequantized_reference(ops, tokens):
    x, w13, w2, weights, ids = random_case(tokens, 72, 36, 4, 2, torch.float32, seed=5)
    s13 = w13.abs().amax(-1) / 127
    s2 = w2.abs().amax(-1) / 127
    q13 = torch.round(w13 / s13[..., None]).to(torch.int8)
    q2 = torch.round(w2 / s2[..., None]).to(torch.int8)
    ref = reference(x, q13.float() * s13[..., None], q2.float() * s2[..., None], weights, ids)
    got = ops.moe_experts(x, q13, q2, s13.contiguous(), s2.contiguous(), None, None, ids, weights, 0, 1.702, 7.0, 0,
                          False)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def test_kernel_rejects_an_expert_id_out_of_range(ops):
    x, w13, w2, weights, ids = random_case(2, 16, 8, 2, 1, torch.float32)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.moe_experts(x, w13, w2, None, None, None, None, ids + 5, weights, 0, 1.702, 7.0, 0, False)


def test_softmax_router_renormalized_or_not_and_softmax_over_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    w, ids = select_experts(logits, RouterSpec(2))
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))
    w, _ = select_experts(logits, RouterSpec(2, renormalize=False))
    torch.testing.assert_close(w, torch.softmax(logits, -1)[:, [1, 2]])
    w, ids = select_experts(logits, RouterSpec(2, softmax_over_top_k=True))
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))


def test_sigmoid_router_chooses_by_biased_scores_and_weighs_by_plain_ones():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    bias = torch.tensor([5.0, 0.0, 0.0])
    w, ids = select_experts(logits, RouterSpec(2, scoring="sigmoid", renormalize=False), bias)
    assert sorted(ids[0].tolist()) == [0, 1]
    torch.testing.assert_close(w, torch.sigmoid(logits)[:, ids[0]])


@pytest.mark.parametrize("spec", [RouterSpec(2), RouterSpec(3, renormalize=False), RouterSpec(1),
                                  RouterSpec(4, softmax_over_top_k=True), RouterSpec(2, scoring="sigmoid"),
                                  RouterSpec(3, scoring="sigmoid", renormalize=False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_routing_equals_select_experts_for_each_router(ops, spec, dtype):
    # 7 tokens over 11 experts (odd sizes); float32 logits are distinct, so both pick the same experts
    logits = torch.randn(7, 11, generator=torch.Generator().manual_seed(3)).to(dtype)
    if dtype == torch.bfloat16:  # bf16 logits may tie: make them distinct so the choice is unambiguous
        logits = (torch.randperm(77, generator=torch.Generator().manual_seed(3)).view(7, 11) / 16.0).to(dtype)
    want_w, want_ids = select_experts(logits, spec)
    got_w, got_ids = ops.moe_route(logits, spec.top_k, {"softmax": 0, "sigmoid": 1}[spec.scoring],
                                   spec.renormalize, spec.softmax_over_top_k)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert got_ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(got_w, want_w.float(), rtol=1e-6, atol=1e-6)


def test_kernel_routing_rejects_top_k_beyond_the_experts(ops):
    with pytest.raises(RuntimeError, match="top_k must be in"):
        ops.moe_route(torch.randn(2, 4), 5, 0, True, False)


def test_unknown_router_scoring_is_a_config_error():
    with pytest.raises(ConfigError, match="scoring"):
        RouterSpec(2, scoring="relu")


def _block(host, shared=False):
    torch.manual_seed(0)
    expert = SharedExpert(torch.nn.Linear(32, 80, bias=False), torch.nn.Linear(40, 32, bias=False)) if shared else None
    block = SparseMoeBlock(32, 4, 24, RouterSpec(2, renormalize=False), torch.float32, shared_expert=expert,
                           shared_gate=shared, host=host, prefix="layers.0.mlp")
    for e in range(4):
        for part, shape in (("gate", (24, 32)), ("up", (24, 32)), ("down", (32, 24))):
            block.experts.load_expert(part, e, torch.randn(shape) * 0.2, f"experts.{e}.{part}")
    torch.nn.init.normal_(block.router.weight)
    if shared:
        torch.nn.init.normal_(block.shared_expert_gate.weight)
    return block


@pytest.mark.parametrize("shared", [False, True])
def test_block_with_and_without_the_kernel_and_shared_expert_agree(ops, shared):
    x = torch.randn(9, 32)
    fused = _block(resolve_host_config(), shared)(x)
    plain = _block(HostConfig(fused_cpu_ops=False), shared)(x)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    assert _block(None).experts.missing() == []


def test_loading_a_wrong_shape_or_unknown_expert_names_the_tensor():
    experts = FusedMoE(2, 16, 8, torch.float32, prefix="model.layers.0.mlp.experts")
    with pytest.raises(CheckpointError, match="experts.0.w1"):
        experts.load_expert("gate", 0, torch.zeros(9, 16), "experts.0.w1")
    with pytest.raises(CheckpointError, match="expert 7"):
        experts.load_expert("gate", 7, torch.zeros(8, 16), "experts.7.w1")
    assert len(experts.missing()) == 6
