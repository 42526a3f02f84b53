"""The batch-invariant mode's tiled bf16 GEMM (``gemm_bf16_inv``): every output has the bits of the GEMV that
decode steps take, whatever the number of rows, their split into calls, the weight tile or the thread count, on
odd sizes too (a K that is not a multiple of 8 or 32, N not a multiple of the tile). So a prompt's linears
computed at once and the same tokens decoded one by one agree bit for bit. The build's own ISA path runs here
(AVX-512 BF16 dot products on a CPU that has them, else fp32 math on AVX2); the AVX2 path on an AVX-512 CPU runs
with ``PAGODA_CPU_ISA=avx2``."""

from __future__ import annotations

import pytest
import torch

from pagoda.host.env import resolve_host_config
from pagoda.modeling.layers.fused_ops import AVX2_GEMV_MAX_ROWS, CpuKernels


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    found = CpuKernels(resolve_host_config(), batch_invariant=True)
    if not found.gemv_path:
        pytest.skip("this build has no bf16 GEMV (neither AVX-512 BF16 nor AVX2 + FMA), so no tiled invariant GEMM")
    return found


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("n,k", [(96, 576), (37, 13), (50, 203), (5, 8), (29, 1000)])
def test_the_tiled_gemm_gives_the_gemvs_bits_at_any_row_count_tile_and_thread_count(kernels, n, k):
    ops = kernels.ops
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(23, k, generator=gen).bfloat16()
    one_by_one = torch.cat([ops.gemv_bf16(x[i:i + 1], w, bias) for i in range(len(x))])
    reference = torch.nn.functional.linear(x.float(), w.float(), bias.float()).bfloat16()
    torch.testing.assert_close(one_by_one, reference, rtol=1.6e-2, atol=1e-3)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for tile in (1, 7, 12, 48):
                # the row groups of both paths (AVX2: 6, 4, 2, 1; AVX-512 BF16: 4, then 3, 2 or 1) and their mixes
                for m in (1, 2, 3, 4, 5, 6, 7, 11, 23):
                    assert torch.equal(bits(ops.gemm_bf16_inv(x[:m], w, bias, tile)), bits(one_by_one[:m])), \
                        (num_threads, tile, m)
            assert torch.equal(bits(ops.gemm_bf16_inv(x, w, None, 48)), bits(ops.gemv_bf16(x, w, None)))
    finally:
        torch.set_num_threads(threads)


def test_a_prompts_rows_have_the_same_bits_in_one_call_in_chunks_and_among_other_rows(kernels):
    gen = torch.Generator().manual_seed(49)
    w = torch.randn(200, 300, generator=gen).bfloat16()
    prompt = torch.randn(61, 300, generator=gen).bfloat16()
    others = torch.randn(40, 300, generator=gen).bfloat16()
    at_once = kernels.linear(prompt, w)
    decoded = torch.cat([kernels.linear(prompt[i:i + 1], w) for i in range(len(prompt))])
    chunked = torch.cat([kernels.linear(prompt[i:i + 16], w) for i in range(0, len(prompt), 16)])
    among = kernels.linear(torch.cat([others[:13], prompt, others[13:]]), w)[13:13 + len(prompt)]
    assert len(prompt) > AVX2_GEMV_MAX_ROWS  # the tiled path, against the GEMV's one-row calls
    for found in (decoded, chunked, among):
        assert torch.equal(bits(found), bits(at_once))


def test_the_tiled_gemm_says_what_is_wrong_with_its_inputs(kernels):
    ops = kernels.ops
    w = torch.randn(8, 16).bfloat16()
    with pytest.raises(RuntimeError, match="x and weight must be bf16"):
        ops.gemm_bf16_inv(torch.randn(9, 16), w, None, 48)
    with pytest.raises(RuntimeError, match=r"x must be \[M, K\]"):
        ops.gemm_bf16_inv(torch.randn(9, 15).bfloat16(), w, None, 48)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.gemm_bf16_inv(torch.randn(9, 16).bfloat16(), w, torch.zeros(7).bfloat16(), 48)
    with pytest.raises(RuntimeError, match="tile_rows must be positive"):
        ops.gemm_bf16_inv(torch.randn(9, 16).bfloat16(), w, None, 0)
