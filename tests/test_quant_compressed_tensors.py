"""compressed-tensors checkpoints: llm-compressor's own output, plus packed ones with act-order g_idx."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pagoda.errors import CheckpointError, ConfigError
from quant_helpers import (
    DATA, FUSED, PROMPTS, compressed_int_checkpoint, edit_checkpoint, fake_quant_fp8, fused_reference, greedy,
    small_llm, write_dense,
)

# written by llm-compressor 0.14 / compressed-tensors 0.19 (contrib/quant-tools/quantize_llmcompressor.py)
LLMC = {"w4a16-gptq": None, "w8a16": None, "fp8-dynamic": "dynamic", "fp8-static": "static"}


def reference_weights(path):
    return {k[: -len(".weight")]: v for k, v in load_file(str(path / "reference" / "dequant.safetensors")).items()}


@pytest.mark.parametrize("scheme", sorted(LLMC))
def test_llm_compressor_checkpoint_generates_the_tokens_transformers_generates(scheme):
    path = DATA / f"ct-{scheme}"
    expected = json.loads((path / "reference" / "generations.json").read_text())
    assert greedy(path, expected["prompts"]) == expected["outputs"]


@pytest.mark.parametrize("scheme", sorted(LLMC))
def test_llm_compressor_layers_equal_compressed_tensors_own_decompression(scheme):
    path = DATA / f"ct-{scheme}"
    ref = reference_weights(path)
    model = small_llm(path, dtype="float32").engine.runner.model
    x = torch.randn(4, 256)
    for i, layer in enumerate(model.layers):
        for fused in FUSED:
            linear = getattr(layer, fused)
            xin = x[:, : linear.in_features]
            if LLMC[scheme] == "dynamic":
                expected_in = fake_quant_fp8(xin)
            elif LLMC[scheme] == "static":
                scales = load_file(str(path / "model.safetensors"))
                names = {"qkv_proj": "self_attn.q_proj", "o_proj": "self_attn.o_proj",
                         "gate_up_proj": "mlp.gate_proj", "down_proj": "mlp.down_proj"}
                expected_in = fake_quant_fp8(xin, scales[f"model.layers.{i}.{names[fused]}.input_scale"].float().item())
            else:
                expected_in = xin
            torch.testing.assert_close(linear(xin), expected_in @ fused_reference(ref, i, fused).t(),
                                       rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", [dict(bits=4, group=32, actorder="group"), dict(bits=8, group=None),
                                  dict(bits=4, group=64)])
def test_packed_int_checkpoints_match_the_dequantized_model_in_full_precision(tmp_path, case):
    ref = compressed_int_checkpoint(tmp_path / "q", **case)
    model = small_llm(tmp_path / "q", dtype="float32").engine.runner.model
    x = torch.randn(3, 128)
    torch.testing.assert_close(model.layers[1].qkv_proj(x), x @ fused_reference(ref, 1, "qkv_proj").t(),
                               rtol=1e-5, atol=1e-5)
    del model
    assert greedy(tmp_path / "q", PROMPTS) == greedy(write_dense(tmp_path / "dense", ref), PROMPTS)


def test_four_bit_checkpoint_weights_take_at_least_three_times_less_memory_than_bf16():
    from pagoda.plugins.quant.memory import weight_memory

    mem = weight_memory(small_llm(DATA / "ct-w4a16-gptq", dtype="bfloat16").engine.runner.model)
    assert mem.linear_bf16_bytes >= 3 * mem.linear_bytes


def test_fp8_checkpoint_weights_take_half_the_memory_of_bf16():
    from pagoda.plugins.quant.memory import weight_memory

    mem = weight_memory(small_llm(DATA / "ct-fp8-dynamic", dtype="bfloat16").engine.runner.model)
    assert mem.linear_bf16_bytes >= 1.9 * mem.linear_bytes


def _corrupt(tmp_path, edit=None, config_edit=None):
    compressed_int_checkpoint(tmp_path, bits=4, group=32)
    return edit_checkpoint(tmp_path, edit, config_edit)


def test_missing_weight_scale_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"missing .*gate_up_proj\.weight_scale#1"):
        small_llm(_corrupt(tmp_path, lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale")), dtype="float32")


def test_weight_shape_that_disagrees_with_the_model_is_refused(tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.o_proj.weight_shape"] = torch.tensor([128, 96])

    with pytest.raises(CheckpointError, match=r"o_proj: weight_shape of shard 0 is \[128, 96\].*expects \[128, 128\]"):
        small_llm(_corrupt(tmp_path, edit), dtype="float32")


def test_packed_weight_of_the_wrong_shape_is_refused_naming_the_tensor(tmp_path):
    name = "model.layers.1.mlp.down_proj.weight_packed"

    def edit(t):
        t[name] = t[name][:, :16].contiguous()

    with pytest.raises(CheckpointError, match=r"down_proj\.weight_packed.*\(128, 16\).*expects \(128, 32\)"):
        small_llm(_corrupt(tmp_path, edit), dtype="float32")


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["config_groups"]["group_0"]["weights"].update({"num_bits": 2}), "num_bits 2 are not supported"),
    (lambda c: c["config_groups"]["group_0"]["weights"].update({"symmetric": False}), "asymmetric"),
    (lambda c: c.update({"format": "marlin-24"}), "format 'marlin-24'"),
    (lambda c: c["config_groups"]["group_0"]["weights"].update({"group_size": 24}), "group_size 24"),
])
def test_unsupported_compressed_tensors_schemes_are_refused(tmp_path, edit, message):
    with pytest.raises(ConfigError, match=message):
        small_llm(_corrupt(tmp_path, config_edit=edit), dtype="float32")
