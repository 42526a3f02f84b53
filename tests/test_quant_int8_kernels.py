"""The W8A8 C++ kernel on every ISA path this machine can run, against torch's arithmetic."""

import pytest
import torch

from pagoda.host import cpu_isa
from pagoda.plugins.quant.cpu_int8_kernel import (
    _SOURCE, CFLAGS, IMPL_AUTO, IMPL_SCALAR, cpu_int8_linear, int8_linear_reference, pack_int8_weight,
    quantize_per_token, unpack_int8_weight)
from tests.isa_builds import build_at

NAME = "pagoda_cpu_int8_linear"
# (activation rows, in_features, out_features): odd sizes leave partial 4-column groups and 16-row blocks
# (decode tiles below 8 rows, prefill tiles from 8, K cut into 256-column chunks, M into 256-row chunks)
SHAPES = [(1, 37, 23), (3, 64, 33), (5, 130, 50), (17, 259, 70), (260, 20, 18)]


def native():
    return build_at(cpu_isa.cpu_isa("auto"), NAME, _SOURCE, CFLAGS)


def avx2():
    return build_at("avx2", NAME, _SOURCE, CFLAGS)


def vnni256():
    """The avx_vnni path: with AVX-VNNI where the CPU has it, else through AVX-512 VNNI's 256-bit form."""
    flags = cpu_isa.cpu_flags()
    if "avx_vnni" in flags:
        return build_at("avx2", NAME + "_avxvnni", _SOURCE, (*CFLAGS, "-mavxvnni"))
    if not {"avx512_vnni", "avx512vl"} <= flags:
        pytest.skip("the avx_vnni path needs AVX-VNNI or AVX-512 VNNI with VL")
    return build_at("avx2", NAME + "_vnni256", _SOURCE, (*CFLAGS, "-mavx512vnni", "-mavx512vl", "-DPAGODA_INT8_VNNI256"))


BUILDS = {"native": native, "avx2": avx2, "avx_vnni": vnni256}
EXPECTED_PATH = {"avx2": "avx2", "avx_vnni": "avx_vnni"}


def random_case(m, k, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4).to(dtype)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) / 100 + 1e-3
    bias = torch.randn(n, generator=gen)
    return x, q, scale, bias


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("impl", [IMPL_AUTO, IMPL_SCALAR])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch_arithmetic_on_odd_shapes(build, impl, dtype):
    kernels = BUILDS[build]()
    if build in EXPECTED_PATH:
        assert kernels.isa_path() == EXPECTED_PATH[build]
    for i, (m, k, n) in enumerate(SHAPES):
        x, q, scale, bias = random_case(m, k, n, dtype, seed=i)
        packed, colsum = pack_int8_weight(q)
        for b in (None, bias):
            got = cpu_int8_linear(kernels, x, packed, colsum, scale, n, b, impl)
            want = int8_linear_reference(x, q, scale, b)
            # integer sums are exact on every path and the float epilogue runs in the same order
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{build} impl {impl} shape {(m, k, n)}")


@pytest.mark.parametrize("build", list(BUILDS))
def test_extreme_codes_do_not_saturate(build):
    # every activation at +-127 against weights of -128 and 127: vpmaddubsw pairs reach 2 * 128 * 127
    kernels = BUILDS[build]()
    k, n = 64, 16
    x = torch.tensor([1.0, -1.0]).repeat(k // 2).view(1, k).repeat(3, 1)
    x[1] = -x[1]
    x[2] = 1.0
    q = torch.full((n, k), -128, dtype=torch.int8)
    q[1::2] = 127
    q[2, ::2] = 127
    scale = torch.ones(n)
    packed, colsum = pack_int8_weight(q)
    got = cpu_int8_linear(kernels, x, packed, colsum, scale, n, None)
    torch.testing.assert_close(got, int8_linear_reference(x, q, scale, None), rtol=0, atol=0)
    assert float(got[2, 0]) == pytest.approx(-128 * k / 127 * 127)


@pytest.mark.parametrize("build", list(BUILDS))
def test_activation_codes_match_round_half_even(build):
    kernels = BUILDS[build]()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 45, generator=gen)
    x[1, 7] = 0.5 * x[1].abs().max() / 127 * 3  # near a rounding midpoint
    x[2] = 0.0  # an all-zero row: scale 0, codes 0
    codes, scales = kernels.quantize_activations(x)
    q, s = quantize_per_token(x)
    # the VNNI paths store q + 128 for vpdpbusd's unsigned operand, the others q itself
    got = codes.to(torch.int32) - 128 if kernels.unsigned_activations() else codes.view(torch.int8).to(torch.int32)
    assert torch.equal(got, q.to(torch.int32))
    assert torch.equal(scales, s.squeeze(1))


def test_packed_weight_unpacks_to_itself():
    q = torch.randint(-128, 128, (37, 22), dtype=torch.int8)
    packed, colsum = pack_int8_weight(q)
    assert packed.shape == (3, 24 * 16)
    assert torch.equal(unpack_int8_weight(packed, 37, 22), q)
    assert torch.equal(colsum[:37], q.sum(1, dtype=torch.int32)) and not colsum[37:].any()


def test_real_avx_vnni_build_compiles():
    """Where the CPU has no AVX-VNNI, its VEX vpdpbusd path is still compiled (not run) to catch build errors."""
    if "avx_vnni" in cpu_isa.cpu_flags():
        pytest.skip("this CPU runs the AVX-VNNI path in the tests above")
    kernels = build_at("avx2", NAME + "_avxvnni", _SOURCE, (*CFLAGS, "-mavxvnni"))
    assert kernels.isa_path() == "avx_vnni"
