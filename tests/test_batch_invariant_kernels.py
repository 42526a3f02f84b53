"""The batch-invariant mode's bf16 GEMM (``invariant_gemm.cpp``): over weights packed at load time, every output
accumulates its K in order in one fp32 lane, so a row's output bits do not depend on the number of rows, their
order, the tiles or the thread count, on odd sizes too (K odd, N not a multiple of 16). A prompt's linears
computed at once and the same tokens decoded one by one agree bit for bit. Both ISA paths run here where the CPU
has them: the build's own (AVX-512 BF16 dot products on a CPU that has them) and the AVX2 one (fp32 FMAs)."""

from __future__ import annotations

import pytest
import torch

from isa_builds import build_at
from pagoda.host.env import resolve_host_config
from pagoda.modeling.layers import fused_ops
from pagoda.modeling.layers.fused_ops import CpuKernels
from pagoda.modeling.layers.linear import Linear, Logits


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    found = CpuKernels(resolve_host_config(), batch_invariant=True)
    if found.packed_gemm_ops is None:
        pytest.skip("this build has no invariant bf16 GEMM (neither AVX-512 BF16 nor AVX2 + FMA)")
    return found


@pytest.fixture(scope="module", params=["native", "avx2"])
def ops(request, kernels):
    """The kernel of each ISA path this CPU runs: the build's own, and the AVX2 one."""
    if request.param == "native":
        return kernels.packed_gemm_ops
    built = build_at("avx2", "pagoda_invariant_gemm", fused_ops._INVARIANT_SOURCE, ["-ffp-contract=off"])
    assert built.path() == "avx2"
    return built


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.fixture
def one_thread_then_two():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("n,k", [(96, 576), (37, 1000), (50, 37), (5, 8), (29, 1), (17, 203), (64, 2)])
def test_a_rows_outputs_have_the_same_bits_at_any_row_count_position_and_thread_count(ops, n, k,
                                                                                     one_thread_then_two):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(100, k, generator=gen).bfloat16()
    x[5] = 0.0
    x[6] = -0.0
    x[7, k // 2] = float("inf")
    x[11, 0] = float("nan")
    packed = ops.pack_bf16(w)
    assert packed.shape == (n, (k + 1) // 2, 2)
    for b in (bias, None):
        alone = torch.cat([ops.gemm_bf16(x[i:i + 1], packed, b) for i in range(len(x))])
        finite = [i for i in range(len(x)) if i not in (7, 11)]
        reference = torch.nn.functional.linear(x[finite].float(), w.float(), None if b is None else b.float())
        torch.testing.assert_close(alone[finite].float(), reference, rtol=1.6e-2,
                                   atol=1e-2 * max(1.0, reference.abs().max().item()))
        assert alone[11].isnan().all() and bits(alone[11]).eq(0x7FC0).all()
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            # every row count of the tiles (AVX-512 BF16: 6 rows, then 5 to 1; AVX2: 4, then 3 to 1), the block
            # of 96 rows the threads share, and rows that start anywhere
            for m in list(range(1, 20)) + [97, 100]:
                assert torch.equal(bits(ops.gemm_bf16(x[:m], packed, b)), bits(alone[:m])), (num_threads, m)
            assert torch.equal(bits(ops.gemm_bf16(x[3:22], packed, b)), bits(alone[3:22]))
            shuffled = torch.randperm(len(x), generator=gen)
            assert torch.equal(bits(ops.gemm_bf16(x[shuffled], packed, b)), bits(alone[shuffled]))


def test_a_prompts_rows_have_the_same_bits_in_one_call_in_chunks_and_among_other_rows(kernels):
    gen = torch.Generator().manual_seed(49)
    w = torch.randn(200, 300, generator=gen).bfloat16()
    prompt = torch.randn(61, 300, generator=gen).bfloat16()
    others = torch.randn(40, 300, generator=gen).bfloat16()
    at_once = kernels.linear(prompt, w)
    decoded = torch.cat([kernels.linear(prompt[i:i + 1], w) for i in range(len(prompt))])
    chunked = torch.cat([kernels.linear(prompt[i:i + 16], w) for i in range(0, len(prompt), 16)])
    among = kernels.linear(torch.cat([others[:13], prompt, others[13:]]), w)[13:13 + len(prompt)]
    packed = kernels.pack_weight(w)
    prepacked = kernels.packed_linear(prompt.view(1, 61, 300), packed).view(61, 200)
    for found in (decoded, chunked, among, prepacked):
        assert torch.equal(bits(found), bits(at_once))


def test_a_linear_layer_and_the_tied_head_hold_their_weights_packed_once_in_the_mode(kernels):
    gen = torch.Generator().manual_seed(3)
    layer = Linear(40, [24, 9], bias=True, dtype=torch.bfloat16, kernels=kernels)
    w = torch.randn(33, 40, generator=gen).bfloat16()
    b = torch.randn(33, generator=gen).bfloat16()
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    layer.process_weights_after_loading()
    # the plain copy is gone: one weight, in the GEMM's layout, with as many elements (an even K)
    assert layer.packed and tuple(layer.weight.shape) == (33, 20, 2)
    x = torch.randn(2, 7, 40, generator=gen).bfloat16()
    assert torch.equal(layer(x), kernels.linear(x, w, b))
    embedding = torch.nn.Embedding(50, 40, dtype=torch.bfloat16)
    logits = Logits(50, kernels)
    hidden = torch.randn(5, 40, generator=gen).bfloat16()
    got = logits(hidden, None, embedding)
    assert got.dtype == torch.float32 and torch.equal(got, kernels.linear(hidden, embedding.weight.data).float())
    assert embedding.weight.shape == (50, 40)  # the token lookup keeps the plain table


def test_the_gemm_says_what_is_wrong_with_its_inputs(ops):
    w = torch.randn(8, 16).bfloat16()
    packed = ops.pack_bf16(w)
    with pytest.raises(RuntimeError, match="x and weight must be bf16"):
        ops.gemm_bf16(torch.randn(9, 16), packed)
    with pytest.raises(RuntimeError, match="must be packed by pack_bf16"):
        ops.gemm_bf16(torch.randn(9, 16).bfloat16(), w)
    with pytest.raises(RuntimeError, match="K matching the packed weight's 8 pairs"):
        ops.gemm_bf16(torch.randn(9, 18).bfloat16(), packed)
    with pytest.raises(RuntimeError, match=r"bias must be \[N\] bf16 \(N = 8\)"):
        ops.gemm_bf16(torch.randn(9, 16).bfloat16(), packed, torch.zeros(7).bfloat16())
    with pytest.raises(RuntimeError, match="not contiguous: pass weight.contiguous"):
        ops.pack_bf16(torch.randn(16, 8).bfloat16().t())
    assert ops.gemm_bf16(torch.empty(0, 16).bfloat16(), packed).shape == (0, 8)
