"""The C++ int kernel (the CPU default) multiplies like the dequantized weight, on every path it has."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.plugins.quant.cpu_int_kernel import IMPL_AUTO, IMPL_SCALAR, cpu_int_linear, int_kernels_or_none
from pagoda.plugins.quant.int_linear import IntPart, apply_int_linear, dequantize_int_rows, install_int_weight
from pagoda.plugins.quant.packing import unpack_uint8
from quant_helpers import (
    DATA, FUSED, PROMPTS, assert_linears_match, gptq_checkpoint, greedy, small_llm, write_dense,
)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """The int kernel, compiled when the first test here runs (not while pytest collects the file, so the test
    workers compile different kernels at the same time)."""
    built = int_kernels_or_none()
    if built is None:
        pytest.skip("no C++ compiler for the int kernel on this machine")
    return built


DIRECT, GEMM = 1 << 30, 1  # gemm_min_rows that force one path or the other


def packed_layer(out_features, in_features, bits, group, dtype, parts=1, seed=0):
    """A module with a random packed weight; ``parts=2`` reads rows of its first half through a permutation."""
    gen = torch.Generator().manual_seed(seed)
    num_groups = -(-in_features // group)
    q = torch.randint(0, 1 << bits, (out_features, in_features), generator=gen)
    scales = torch.rand(out_features, num_groups, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 1 << bits, (out_features, num_groups), generator=gen).float()
    layout = [IntPart(0, out_features, None)]
    if parts == 2:
        half = out_features // 2
        layout = [IntPart(0, half, torch.randperm(in_features, generator=gen)), IntPart(half, out_features, None)]
    layer = nn.Module()
    layer.in_features, layer.out_features, layer.quant_dtype = in_features, out_features, dtype
    install_int_weight(layer, q, scales, zeros, bits, group, layout, "cpu")
    return layer


def reference_weight(layer) -> torch.Tensor:
    """``[out, in]`` float32 weight in the input's column order, from the layer's own stored scales and zeros."""
    gs = layer.int_group_size
    q = unpack_uint8(layer.w_q, layer.int_bits).float()[:, : layer.in_features]
    g = torch.arange(layer.in_features) // gs
    w = (q - layer.w_zeros.float()[:, g]) * layer.w_scales.float()[:, g]
    for i, (start, end, has_perm) in enumerate(layer.int_parts):
        if has_perm:
            perm = getattr(layer, f"w_perm_{i}")
            rows = w[start:end].clone()
            w[start:end, perm] = rows  # y = x[:, perm] @ Wp^T  ==  x @ W^T with W[:, perm] = Wp
    return w


def assert_matches(y: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # float32: summation order only; bf16 / fp16: the output's own rounding (relative to the largest output)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    scale = expected.abs().max().clamp(min=1.0)
    assert ((y.float() - expected).abs().max() / scale).item() < tol


def assert_one_bf16_rounding_of(y: torch.Tensor, exact: torch.Tensor) -> None:
    """``y`` (bf16) is the fp32 ``exact`` rounded once to bf16, up to fp32 summation order: what the AVX2
    path's GEMM over widened tiles gives (fp32 products of the bf16 weight, one rounding at the end)."""
    assert y.dtype == torch.bfloat16
    assert ((y.float() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-6).all()


SHAPES = [(7, 100), (96, 576), (1728, 576), (96, 100)]


def reference_like_torch(layer) -> torch.Tensor:
    """The torch path's dequantized weight for a layer without a permutation."""
    return dequantize_int_rows(layer, 0, layer.out_features)


def _avx2_kernels():
    from isa_builds import build_at
    from pagoda.plugins.quant import cpu_int_kernel

    return build_at("avx2", "pagoda_cpu_int_linear", cpu_int_kernel._SOURCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bits", [4, 8])
# batch 1, 4-bit reads both nibbles of a byte at once where the halves of a row are multiples of 8 columns:
# halves 64 (aligned to the groups), 288 / 192 / 24 (a group cut by the halves' boundary), 20 (not: segments)
@pytest.mark.parametrize("group,out_features,in_features", [(32, 7, 100), (64, 96, 576), (128, 13, 333),
                                                            (64, 1728, 576), (16, 5, 40), (8, 9, 40)])
def test_the_avx2_path_equals_the_dequantized_weight_for_every_batch_size(out_features, in_features, group, bits,
                                                                         dtype):
    avx2 = _avx2_kernels()
    assert avx2.isa_path() == "avx2"
    layer = packed_layer(out_features, in_features, bits, group, dtype, parts=2, seed=out_features + bits)
    w = reference_weight(layer)
    plain = packed_layer(out_features, in_features, bits, group, dtype, seed=out_features + bits)
    bias = torch.randn(out_features).to(dtype)
    for rows in (1, 2, 3, 5, 17, 33):  # the widened GEMM pads 17 and 33 rows to multiples of 16
        x = torch.randn(rows, in_features).to(dtype)
        expected = x.float() @ w.t() + bias.float()
        for gemm_min_rows in (DIRECT, GEMM):
            y = cpu_int_linear(avx2, layer, x, bias, IMPL_AUTO, gemm_min_rows)
            assert y.dtype == dtype and y.shape == (rows, out_features)
            assert_matches(y, expected, dtype)
    x = torch.randn(9, in_features).to(dtype)
    got = cpu_int_linear(avx2, plain, x, None, IMPL_AUTO, GEMM, 4096)
    if dtype == torch.float16:  # the GEMM path's tile holds what the torch path dequantizes, bit for bit
        torch.testing.assert_close(got, F.linear(x, reference_like_torch(plain)), rtol=0, atol=0)
    elif dtype == torch.bfloat16:  # the widened tiles hold the torch path's bf16 weight
        assert_one_bf16_rounding_of(got, x.float() @ reference_like_torch(plain).float().t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_kernel_equals_the_dequantized_weight_for_every_batch_size(out_features, in_features, group, bits, dtype,
                                                                  kernels):
    # in 100 pads the last group of every group size; 576 / 128 leaves a partial group too
    layer = packed_layer(out_features, in_features, bits, group, dtype, parts=2, seed=out_features + group)
    w = reference_weight(layer)
    bias = torch.randn(out_features).to(dtype)
    for rows in (1, 3, 17, 64):
        x = torch.randn(rows, in_features).to(dtype)
        expected = x.float() @ w.t() + bias.float()
        for gemm_min_rows in (DIRECT, GEMM):
            y = cpu_int_linear(kernels, layer, x, bias, IMPL_AUTO, gemm_min_rows)
            assert y.dtype == dtype and y.shape == (rows, out_features)
            assert_matches(y, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits,group,in_features", [(4, 32, 100), (8, 64, 576), (4, 16, 80), (4, 100, 100),
                                                     (4, 8, 64)])
def test_portable_scalar_path_equals_the_dequantized_weight(bits, group, in_features, dtype, kernels):
    # the loop machines without AVX-512 run, and odd group sizes (8, 16, a whole 100-column row)
    layer = packed_layer(40, in_features, bits, group, dtype, parts=2)
    w = reference_weight(layer)
    for rows in (1, 3, 17):
        x = torch.randn(rows, in_features).to(dtype)
        for impl in (IMPL_SCALAR, IMPL_AUTO):
            for gemm_min_rows in (DIRECT, GEMM):
                assert_matches(cpu_int_linear(kernels, layer, x, None, impl, gemm_min_rows), x.float() @ w.t(), dtype)


@pytest.mark.parametrize("bits", [4, 8])
def test_gemm_path_multiplies_the_torch_paths_bf16_weight(bits, kernels):
    # large batches dequantize tiles to bf16 exactly as the torch path does, so both round alike
    layer = packed_layer(300, 576, bits, 64, torch.bfloat16)
    x = torch.randn(40, 576).to(torch.bfloat16)
    torch_weight = dequantize_int_rows(layer, 0, 300)
    expected = F.linear(x, torch_weight)
    one_tile = cpu_int_linear(kernels, layer, x, None, IMPL_AUTO, GEMM, 1024)
    if kernels.isa_path() == "avx2":  # torch has no fast bf16 GEMM there: fp32 GEMM over widened tiles
        assert_one_bf16_rounding_of(one_tile, x.float() @ torch_weight.float().t())
    else:  # one tile: the same GEMM as F.linear on the same weight, so the same bits
        torch.testing.assert_close(one_tile, expected, rtol=0, atol=0)
    assert_matches(cpu_int_linear(kernels, layer, x, None, IMPL_AUTO, GEMM, 64), expected.float(), torch.bfloat16)


def test_leading_dimensions_and_bias_follow_f_linear():
    layer = packed_layer(96, 576, 4, 128, torch.bfloat16)
    x = torch.randn(2, 3, 576).to(torch.bfloat16)
    bias = torch.randn(96).to(torch.bfloat16)
    y = apply_int_linear(layer, x, bias)
    assert y.shape == (2, 3, 96)
    assert_matches(y.reshape(6, 96), x.reshape(6, 576).float() @ reference_weight(layer).t() + bias.float(),
                   torch.bfloat16)


def test_cpu_is_the_default_int_kernel_on_a_cpu(monkeypatch):
    from pagoda.plugins.quant.base import kernel_for_device

    monkeypatch.delenv("PAGODA_QUANT_KERNEL", raising=False)
    assert kernel_for_device() == "cpu"
    assert kernel_for_device("auto") == "cpu"
    assert kernel_for_device("torch") == "torch"


def test_act_order_checkpoint_generates_the_dequantized_models_tokens_with_the_cpu_kernel(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGODA_QUANT_KERNEL", raising=False)
    ref = gptq_checkpoint(tmp_path / "q", bits=4, group=32, desc_act=True)
    model = small_llm(tmp_path / "q", dtype="float32").engine.runner.model
    assert model.layers[0].qkv_proj.int_kernel == "cpu" and model.layers[0].qkv_proj.int_parts[0][2]
    assert_linears_match(model, ref)
    assert greedy(tmp_path / "q", PROMPTS) == greedy(write_dense(tmp_path / "dense", ref), PROMPTS)


def test_bf16_model_layers_agree_with_the_torch_kernel(monkeypatch):
    # an AutoAWQ-format checkpoint in the test data, run in bf16 through both kernels
    monkeypatch.setenv("PAGODA_QUANT_KERNEL", "torch")
    torch_model = small_llm(DATA / "awq-g64", dtype="bfloat16").engine.runner.model
    monkeypatch.setenv("PAGODA_QUANT_KERNEL", "cpu")
    cpu_model = small_llm(DATA / "awq-g64", dtype="bfloat16").engine.runner.model
    assert cpu_model.layers[0].gate_up_proj.int_kernel == "cpu"
    x = torch.randn(3, 256).to(torch.bfloat16)
    for torch_layer, cpu_layer in zip(torch_model.layers, cpu_model.layers):
        for fused in FUSED:
            xin = x[:, : getattr(cpu_layer, fused).in_features]
            expected = getattr(torch_layer, fused)(xin).float()
            assert_matches(getattr(cpu_layer, fused)(xin), expected, torch.bfloat16)
