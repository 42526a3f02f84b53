"""The shared int runtime: packed weights multiply like their dequantized reference, on torch and Triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pagoda.errors import CheckpointError
from pagoda.plugins.quant.int_linear import (
    IntPart, apply_int_linear, dequantize_int_rows, install_int_weight, parts_from_g_idx)


def make_layer(out_features, in_features, bits, group, dtype=torch.float32, kernel="torch", perm_rows=None, seed=0):
    """A bare module holding a random packed weight; returns it and its dense reference ``[out, in]``."""
    gen = torch.Generator().manual_seed(seed)
    num_groups = -(-in_features // group)
    q = torch.randint(0, 1 << bits, (out_features, in_features), generator=gen)
    scales = torch.rand(out_features, num_groups, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 1 << bits, (out_features, num_groups), generator=gen).float()
    g = torch.arange(in_features) // group
    dense = (q.float() - zeros[:, g]) * scales[:, g]  # in the (permuted) column order of q
    parts = [IntPart(0, out_features, None)]
    if perm_rows is not None:  # rows [0, perm_rows) read the input through a permutation
        perm = torch.randperm(in_features, generator=gen)
        parts = [IntPart(0, perm_rows, perm), IntPart(perm_rows, out_features, None)]
        unpermuted = dense[:perm_rows].clone()
        dense[:perm_rows] = 0
        dense[:perm_rows, perm] = unpermuted  # y = x[:, perm] @ Wp^T  ==  x @ W^T with W[:, perm] = Wp
    layer = nn.Module()
    layer.in_features, layer.out_features, layer.quant_dtype = in_features, out_features, dtype
    install_int_weight(layer, q, scales, zeros, bits, group, parts, kernel)
    return layer, dense


@pytest.mark.parametrize("bits,group,in_features", [(4, 32, 96), (8, 64, 128), (4, 32, 80), (4, 128, 64)])
def test_torch_path_multiplies_like_the_dequantized_weight(bits, group, in_features):
    layer, dense = make_layer(40, in_features, bits, min(group, 128))
    x = torch.randn(3, in_features)
    torch.testing.assert_close(apply_int_linear(layer, x, None), x @ dense.t(), rtol=1e-5, atol=1e-5)


def test_permuted_parts_read_their_inputs_in_checkpoint_order():
    layer, dense = make_layer(48, 64, 4, 16, perm_rows=32)
    x = torch.randn(2, 64)
    bias = torch.randn(48)
    torch.testing.assert_close(apply_int_linear(layer, x, bias), x @ dense.t() + bias, rtol=1e-5, atol=1e-5)


def test_packed_weight_is_stored_at_half_a_byte_per_4bit_value():
    layer, _ = make_layer(64, 128, 4, 32)
    assert layer.w_q.dtype == torch.uint8 and tuple(layer.w_q.shape) == (64, 64)
    assert not any(p.is_floating_point() and p.numel() >= 64 * 128 for p in layer.parameters())


def test_bf16_dequantization_matches_float32_to_bf16_precision():
    layer, dense = make_layer(32, 64, 4, 32, dtype=torch.bfloat16)
    w = dequantize_int_rows(layer, 0, 32)
    assert w.dtype == torch.bfloat16
    torch.testing.assert_close(w.float(), dense, rtol=1e-2, atol=1e-2)


def test_g_idx_is_turned_into_one_permutation_per_distinct_shard():
    perm = torch.randperm(64)
    g_idx = torch.empty(64, dtype=torch.int64).scatter_(0, perm, torch.arange(64) // 16)
    parts, perms = parts_from_g_idx([g_idx, g_idx, torch.arange(64) // 16], [(0, 8), (8, 12), (12, 16)], 16,
                                    ["a", "b", "c"])
    assert [(p.row_start, p.row_end, p.perm is not None) for p in parts] == [(0, 12, True), (12, 16, False)]
    assert torch.equal(g_idx[perms[0]], torch.arange(64) // 16)  # sorted columns form contiguous groups
    assert perms[2] is None


def test_g_idx_with_uneven_groups_is_refused_by_name():
    with pytest.raises(CheckpointError, match="'layer.g_idx' does not assign 16 input columns"):
        parts_from_g_idx([torch.zeros(64, dtype=torch.int64)], [(0, 4)], 16, ["layer.g_idx"])


TRITON_CHECK = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_quant_int_linear import make_layer
from pagoda.plugins.quant.int_linear import apply_int_linear
for bits, group, in_features, perm_rows in [(4, 32, 96, None), (8, 32, 64, None), (4, 16, 80, 16)]:
    torch_layer, dense = make_layer(40, in_features, bits, group, perm_rows=perm_rows)
    triton_layer, _ = make_layer(40, in_features, bits, group, kernel="triton", perm_rows=perm_rows)
    x = torch.randn(5, in_features)
    expected = apply_int_linear(torch_layer, x, None)
    torch.testing.assert_close(apply_int_linear(triton_layer, x, None), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(expected, x @ dense.t(), rtol=1e-5, atol=1e-5)
print("triton ok")
"""


def test_triton_kernel_matches_the_torch_path_under_the_interpreter():
    # a fresh process: TRITON_INTERPRET must be set before anything imports triton
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PAGODA_CPU_THREADS": "1"}
    script = TRITON_CHECK.format(tests=str(Path(__file__).parent))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "triton ok" in result.stdout, result.stderr[-3000:]
