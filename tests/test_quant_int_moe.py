"""Group-quantized routed experts kept packed (plugins/quant/int_moe.py): the C++ kernel (this CPU's path, the
AVX2 build, the scalar loops) and the torch path compute what the same experts dequantized to float32 compute,
in float32 and bfloat16, odd sizes, 1 to 19 tokens, top-3 of 5, 4 and 8 bits, with and without zero points, silu
or gpt-oss's clamped SwiGLU with expert biases, in act-order (each expert's columns sorted by its own g_idx, the
gate's and the up's apart); the packed experts take a quarter of the bytes and refuse tensors that do not fit them."""

from __future__ import annotations

import pytest
import torch

from pagoda.errors import CheckpointError
from pagoda.host.env import resolve_host_config
from pagoda.modeling.layers.moe import FusedMoE
from pagoda.plugins.quant import cpu_int_kernel
from pagoda.plugins.quant.cpu_int_kernel import IMPL_AUTO, IMPL_SCALAR, TILE_ROWS
from pagoda.plugins.quant.int_moe import IntMoeMethod
from moe_helpers import check_experts_output, load_bias, random_routing

NUM_EXPERTS, TOP_K = 5, 3
TOKENS = (1, 4, 19)


def _experts(dtype, hidden, inter, bits, group, symmetric, kernel="cpu", seed=0, activation="silu", bias=False,
             act_order=False):
    """(packed FusedMoE, the same experts dequantized to float32 in a torch-only FusedMoE); ``act_order``: each
    projection's columns assigned to groups by a g_idx of its own (GPTQ desc_act), except expert 0's up projection,
    which shares its gate's (as a checkpoint's gate and up quantized from the same inputs do)."""
    gen = torch.Generator().manual_seed(seed)
    checkpoint: dict[str, tuple[torch.Tensor, ...]] = {}
    method = IntMoeMethod(bits, group, lambda tensors, name: checkpoint[name], kernel, resolve_host_config(), "GPTQ",
                          act_order=act_order)
    layer = dict(activation=activation, has_bias=bias, limit=1.0, prefix="l.experts")
    packed = FusedMoE(NUM_EXPERTS, hidden, inter, dtype, host=resolve_host_config(), quant_method=method, **layer)
    reference = FusedMoE(NUM_EXPERTS, hidden, inter, torch.float32, host=None, **layer)
    maxq = (1 << bits) - 1
    for e in range(NUM_EXPERTS):
        for part, (rows, cols) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            g = cols if group == -1 else group
            groups = -(-cols // g)
            q = torch.randint(0, maxq + 1, (rows, cols), generator=gen)
            scales = torch.rand(rows, groups, generator=gen) * 0.02 + 1e-3
            zeros = (torch.full((rows, groups), float((maxq + 1) // 2)) if symmetric
                     else torch.randint(0, maxq + 1, (rows, groups), generator=gen).float())
            name = f"l.experts.{e}.{part}_proj"
            col_group = torch.arange(cols) // g  # the packed scales are in the model dtype
            if act_order and (e, part) == (0, "up"):
                col_group = checkpoint["l.experts.0.gate_proj"][3]
            elif act_order:
                col_group = col_group[torch.randperm(cols, generator=gen)]
            checkpoint[name] = (q, scales, zeros, col_group if act_order else None)
            packed.load_quantized(part, e, {}, name)
            reference.load_expert(part, e, (q - zeros[:, col_group]) * scales.to(dtype).float()[:, col_group], name)
            if bias:
                load_bias((packed, reference), part, e, rows, dtype, gen, name, std=0.1)
    assert not packed.missing() and packed.w13 is None
    return packed, reference


def _avx2_kernels():
    from isa_builds import build_at

    return build_at("avx2", "pagoda_cpu_int_linear", cpu_int_kernel._SOURCE)


def _run_kernel(kernels, layer, x, weights, ids, impl):
    method = layer.quant_method
    orders = getattr(layer, "w13_perm", None), getattr(layer, "w2_perm", None)
    return kernels.int_moe_experts(x, layer.w13_q, layer.w13_scales, layer.w13_zeros, layer.w2_q, layer.w2_scales,
                                   layer.w2_zeros, None, None, *orders, ids, weights, method.bits, 0,
                                   method.group_of(layer.hidden_size), method.group_of(layer.intermediate_size), 0,
                                   1.702, 7.0, impl, cpu_int_kernel.default_gemm_min_rows(kernels), TILE_ROWS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits, group, symmetric, hidden, inter, act_order", [
    (4, 8, False, 37, 23, False),  # odd sizes: padded last groups, an odd number of nibbles
    (4, 16, True, 37, 23, False),
    (4, 32, False, 128, 64, False),  # halves aligned to 32 columns: batch 1 reads both nibbles of a byte at once
    (4, -1, True, 37, 23, False),  # one group per row
    (8, 16, False, 37, 23, False),
    (4, 8, False, 37, 23, True),  # act-order: every projection's own column order, the last groups short
    (4, 32, False, 128, 64, True),
    (8, 16, True, 37, 23, True),
])
def test_packed_experts_compute_what_their_dequantized_weights_compute(dtype, bits, group, symmetric, hidden, inter,
                                                                       act_order):
    packed, reference = _experts(dtype, hidden, inter, bits, group, symmetric, act_order=act_order)
    kernels = packed.int_kernels
    assert kernels is not None, "the int kernel builds on this machine"
    paths = [("auto", lambda x, w, i: packed(x, w, i)),
             ("scalar", lambda x, w, i: _run_kernel(kernels, packed, x, w, i, IMPL_SCALAR))]
    if dtype == torch.bfloat16 or bits == 4:  # the AVX2 build, once per shape and dtype
        avx2 = _avx2_kernels()
        paths.append(("avx2", lambda x, w, i: _run_kernel(avx2, packed, x, w, i, IMPL_AUTO)))
    for seed, tokens in enumerate(TOKENS):  # 19 tokens: about 11 per expert, the dequantized-tile GEMM
        x, weights, ids = random_routing(tokens, hidden, seed, NUM_EXPERTS, TOP_K)
        xd = x.to(dtype)
        want = reference(xd.float(), weights, ids)
        for path, run in paths:
            got = run(xd, weights, ids)
            assert got.dtype == dtype and got.shape == (tokens, hidden), path
            check_experts_output(got, want, dtype)
        with torch.inference_mode():  # as the engine runs it: the kernel's threads take the mode too
            check_experts_output(packed(xd, weights, ids), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", ["cpu", "torch"])
def test_int_experts_take_the_clamped_swiglu_and_expert_biases(dtype, kernel):
    packed, reference = _experts(dtype, 37, 23, 4, 8, False, kernel=kernel, seed=3, activation="clamped_swiglu",
                                 bias=True)
    for seed, tokens in enumerate(TOKENS):
        x, weights, ids = random_routing(tokens, 37, seed, NUM_EXPERTS, TOP_K)
        check_experts_output(packed(x.to(dtype), weights, ids), reference(x.to(dtype).float(), weights, ids), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act_order", [False, True])
def test_the_torch_path_dequantizes_only_the_chosen_experts_and_computes_the_same(dtype, act_order):
    packed, reference = _experts(dtype, 37, 23, 4, 8, False, kernel="torch", seed=1, act_order=act_order)
    assert packed.int_kernels is None and "torch" in packed.isa_path()
    for seed, tokens in enumerate(TOKENS):
        x, weights, ids = random_routing(tokens, 37, seed, NUM_EXPERTS, TOP_K)
        ids = torch.tensor([1, 2, 3])[ids.argsort(dim=1)]  # experts 0 and 4 never: the subset is reindexed
        check_experts_output(packed(x.to(dtype), weights, ids), reference(x.to(dtype).float(), weights, ids), dtype)


def test_packed_4bit_experts_take_a_quarter_of_the_bf16_bytes_plus_their_scales():
    hidden, inter, group = 128, 64, 32
    packed, _ = _experts(torch.bfloat16, hidden, inter, 4, group, False)
    bf16 = FusedMoE(NUM_EXPERTS, hidden, inter, torch.bfloat16, host=None)
    weights = 3 * hidden * inter
    assert bf16.expert_bytes() == 2 * weights
    # half a byte per weight, and a bf16 scale and zero point per group of 32
    assert packed.expert_bytes() == weights // 2 + 2 * 2 * weights // group
    assert packed.expert_bytes() / bf16.expert_bytes() == pytest.approx(0.3125)
    act_order, _ = _experts(torch.bfloat16, hidden, inter, 4, group, False, act_order=True)
    # and an int64 column order per projection's input: the gate's and the up's of hidden, the down's of inter
    assert act_order.expert_bytes() == packed.expert_bytes() + 8 * (2 * hidden + inter)


def test_tensors_that_do_not_fit_the_packed_experts_are_named():
    packed, _ = _experts(torch.float32, 37, 23, 4, 8, False)
    with pytest.raises(CheckpointError, match="holds quantized experts, but the tensor is torch.float32"):
        packed.load_expert("gate", 0, torch.zeros(23, 37), "l.experts.0.gate_proj.weight")
    method = packed.quant_method
    method.unpack = lambda tensors, name: (torch.zeros(23, 36, dtype=torch.long), torch.ones(23, 5), torch.ones(23, 5),
                                           None)
    with pytest.raises(CheckpointError, match=r"'l.experts.1.up_proj' is \(23, 36\) but the model expects \(23, 37\)"):
        packed.load_quantized("up", 1, {}, "l.experts.1.up_proj")
    reordered = (torch.arange(37) // 8).flip(0)
    method.unpack = lambda tensors, name: (torch.zeros(23, 37, dtype=torch.long), torch.ones(23, 5), torch.ones(23, 5),
                                           reordered)
    with pytest.raises(CheckpointError, match="its g_idx reorders the input columns, but the GPTQ config does not say "
                                              "act-order"):
        packed.load_quantized("up", 1, {}, "l.experts.1.up_proj")
    # a g_idx whose groups are not group_size columns each
    method.unpack = lambda tensors, name: (torch.zeros(23, 37, dtype=torch.long), torch.ones(23, 5), torch.ones(23, 5),
                                           torch.arange(37) % 5)
    with pytest.raises(CheckpointError, match="'l.experts.1.up_proj.g_idx' does not assign 8 input columns to each"):
        packed.load_quantized("up", 1, {}, "l.experts.1.up_proj")
    with pytest.raises(CheckpointError, match="names expert 5, but config.json gives 5 experts"):
        packed.load_quantized("up", 5, {}, "l.experts.5.up_proj")


def test_act_order_experts_are_dequantized_at_load_under_tensor_parallelism(monkeypatch, caplog):
    """A rank's slice of the intermediate columns would cut an act-order down projection's scattered groups: the
    GPTQ and compressed-tensors configs then leave the experts to be dequantized at load, and say why."""
    from pagoda.execution import distributed
    from pagoda.plugins.quant.compressed_tensors import CompressedTensorsConfig
    from pagoda.plugins.quant.gptq import GPTQConfig

    gptq = GPTQConfig(None, {"bits": 4, "group_size": 32, "desc_act": True})
    compressed = CompressedTensorsConfig(None, {"format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": 32, "actorder": "group"}}}})
    for config in (gptq, compressed):
        assert config.moe_method("model.layers.0.mlp").act_order
    monkeypatch.setattr(distributed, "_current", distributed.TensorParallel(rank=0, size=2))
    with caplog.at_level("INFO", logger="pagoda.plugins.quant.int_moe"):
        assert gptq.moe_method("model.layers.0.mlp") is None
        assert compressed.moe_method("model.layers.1.mlp") is None
    assert "model.layers.0.mlp: GPTQ act-order experts are dequantized at load" in caplog.text
    assert "model.layers.1.mlp: compressed-tensors act-order experts are dequantized at load" in caplog.text
    assert not GPTQConfig(None, {"bits": 4, "group_size": 32}).moe_method("model.layers.0.mlp").act_order
