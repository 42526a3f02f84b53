"""MXFP4 routed experts kept packed (plugins/quant/mxfp4.py): the int kernel's MoE call on FP4 codes (this CPU's
path, the AVX2 build, the scalar loops) and the torch path compute what the experts decoded by transformers' own
MXFP4 conversion compute, in float32 and bfloat16, with gpt-oss's clamped SwiGLU and expert biases or silu(gate) *
up, 1 to 19 tokens, top-3 of 5, input sizes of 1 to 5 blocks of 32; the experts hold half a byte per weight plus
one byte per 32, and refuse tensors that do not fit them."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from pagoda.errors import CheckpointError
from pagoda.host.env import resolve_host_config
from pagoda.modeling.layers.moe import FusedMoE
from pagoda.plugins.quant import cpu_int_kernel
from pagoda.plugins.quant.cpu_int_kernel import TILE_ROWS
from pagoda.plugins.quant.mxfp4 import Mxfp4MoeMethod
from moe_helpers import check_experts_output, check_kernel_paths, load_bias, random_routing

NUM_EXPERTS, TOP_K = 5, 3
TOKENS = (1, 4, 19)
ALPHA, LIMIT = 1.702, 2.0  # a low limit: the clamps act on many of the random sums


def _mxfp4(gen, experts, rows, cols):
    """Random checkpoint tensors of one stacked projection: blocks ``[E, rows, cols / 32, 16]``, scales
    ``[E, rows, cols / 32]`` (exponents around 2^-5)."""
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(119, 125, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def _experts(dtype, hidden, inter, activation="clamped_swiglu", bias=True, kernel="cpu", seed=0):
    """(packed FusedMoE, the same experts decoded by transformers to float32 in a torch-only FusedMoE)."""
    gen = torch.Generator().manual_seed(seed)
    host = resolve_host_config()
    layers = [FusedMoE(NUM_EXPERTS, hidden, inter, layer_dtype, activation=activation, has_bias=bias,
                       alpha=ALPHA, limit=LIMIT, host=layer_host, prefix="l.experts", quant_method=method)
              for layer_dtype, layer_host, method in ((dtype, host, Mxfp4MoeMethod(kernel, host)),
                                                      (torch.float32, None, None))]
    packed, reference = layers
    for parts, (rows, cols) in ((("gate", "up"), (2 * inter, hidden)), (("down",), (hidden, inter))):
        blocks, scales = _mxfp4(gen, NUM_EXPERTS, rows, cols)
        decoded = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, rows, cols]
        for e in range(NUM_EXPERTS):
            for i, part in enumerate(parts):  # gate and up rows interleaved, as gpt-oss stores them
                row = slice(i, None, len(parts))
                name = f"l.experts.{part}_proj"
                packed.load_quantized(part, e, {"blocks": blocks[e, row], "scales": scales[e, row]}, name)
                reference.load_expert(part, e, decoded[e, row], name)
                if bias:
                    load_bias((packed, reference), part, e, rows // len(parts), dtype, gen, name)
    assert not packed.missing() and packed.w13 is None
    return packed, reference


def _run_kernel(kernels, layer, x, weights, ids, impl):
    return kernels.int_moe_experts(x, layer.w13_q, layer.w13_scales, None, layer.w2_q, layer.w2_scales, None,
                                   layer.b13, layer.b2, None, None, ids, weights, 4, 1, 32, 32, 1, ALPHA, LIMIT, impl,
                                   cpu_int_kernel.default_gemm_min_rows(kernels), TILE_ROWS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hidden, inter", [
    (96, 160),  # 3 and 5 blocks: rows of 48 and 80 bytes, a block cut where the high nibbles begin
    (128, 64),  # halves aligned to 32 columns: batch 1 reads both nibbles of a byte at once
    (32, 32),  # one block per row
])
def test_packed_mxfp4_experts_compute_what_their_decoded_weights_compute(dtype, hidden, inter):
    packed, reference = _experts(dtype, hidden, inter)
    # 19 tokens: about 11 per expert, the dequantized-tile GEMM
    check_kernel_paths(packed, reference, _run_kernel, hidden, dtype, TOKENS, NUM_EXPERTS, TOP_K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_experts_without_biases_run_packed_too(dtype):
    packed, reference = _experts(dtype, 64, 96, activation="silu", bias=False, seed=2)
    for seed, tokens in enumerate(TOKENS):
        x, weights, ids = random_routing(tokens, 64, seed, NUM_EXPERTS, TOP_K)
        check_experts_output(packed(x.to(dtype), weights, ids), reference(x.to(dtype).float(), weights, ids), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_torch_path_decodes_only_the_chosen_experts_and_computes_the_same(dtype):
    packed, reference = _experts(dtype, 96, 64, kernel="torch", seed=1)
    assert packed.int_kernels is None and packed.isa_path() == "MXFP4 experts, dequantized per call (torch)"
    for seed, tokens in enumerate(TOKENS):
        x, weights, ids = random_routing(tokens, 96, seed, NUM_EXPERTS, TOP_K)
        ids = torch.tensor([1, 2, 3])[ids.argsort(dim=1)]  # experts 0 and 4 never: the subset is reindexed
        check_experts_output(packed(x.to(dtype), weights, ids), reference(x.to(dtype).float(), weights, ids), dtype)


def test_mxfp4_experts_take_half_a_byte_per_weight_and_a_byte_per_block():
    hidden, inter = 128, 64
    packed, _ = _experts(torch.bfloat16, hidden, inter)
    bf16 = FusedMoE(NUM_EXPERTS, hidden, inter, torch.bfloat16, host=None)
    weights = 3 * hidden * inter
    assert packed.w13_q.dtype == packed.w13_scales.dtype == torch.uint8 and not hasattr(packed, "w13_zeros")
    assert packed.expert_bytes() == weights // 2 + weights // 32
    assert packed.expert_bytes() / bf16.expert_bytes() == pytest.approx(0.265625)


def test_mxfp4_tensors_that_do_not_fit_the_experts_are_named():
    packed, _ = _experts(torch.float32, 64, 32, kernel="torch")
    blocks = torch.zeros(32, 2, 16, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match=r"l.experts.up_proj_blocks / l.experts.up_proj_scales are "
                                              r"torch.uint8 / torch.float32"):
        packed.load_quantized("up", 1, {"blocks": blocks, "scales": torch.zeros(32, 2)}, "l.experts.up_proj")
    with pytest.raises(CheckpointError, match=r"hold \(32, 2, 16\) and \(32, 3\) per expert, which do not fit"):
        packed.load_quantized("up", 1, {"blocks": blocks, "scales": torch.zeros(32, 3, dtype=torch.uint8)},
                              "l.experts.up_proj")
    with pytest.raises(CheckpointError, match=r"'l.experts.down_proj' is \(64, 64\) but the model expects \(64, 32\)"):
        packed.load_quantized("down", 0, {"blocks": torch.zeros(64, 2, 16, dtype=torch.uint8),
                                          "scales": torch.zeros(64, 2, dtype=torch.uint8)}, "l.experts.down_proj")
