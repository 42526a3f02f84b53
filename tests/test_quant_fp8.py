"""FP8: vLLM-style ``quant_method: fp8`` checkpoints and online ``--quantization fp8`` of dense ones."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.errors import CheckpointError, ConfigError
from pagoda.plugins.quant.memory import weight_memory
from quant_helpers import (FUSED, PROMPTS, TINY, fake_quant_fp8, fp8_checkpoint, fused_reference, greedy, small_llm,
                           write_dense)

FIRST_MODULE = {"qkv_proj": "self_attn.q_proj", "o_proj": "self_attn.o_proj", "gate_up_proj": "mlp.gate_proj",
                "down_proj": "mlp.down_proj"}


@pytest.mark.parametrize("scheme,block", [("dynamic", None), ("static", None), ("dynamic", (32, 64))])
def test_every_fp8_linear_equals_its_dequantized_weight_on_fp8_rounded_inputs(tmp_path, scheme, block):
    ref, input_scales = fp8_checkpoint(tmp_path / "q", scheme, block)
    model = small_llm(tmp_path / "q", dtype="float32").engine.runner.model
    x = torch.randn(5, 256)
    for i, layer in enumerate(model.layers):
        for fused in FUSED:
            linear = getattr(layer, fused)
            xin = x[:, : linear.in_features]
            scale = input_scales.get(f"model.layers.{i}.{FIRST_MODULE[fused]}")
            expected = fake_quant_fp8(xin, scale) @ fused_reference(ref, i, fused).t()
            torch.testing.assert_close(linear(xin), expected, rtol=1e-5, atol=1e-4)


def test_online_fp8_generates_like_the_dense_model_with_fp8_rounded_weights(tmp_path):
    dense = load_file(str(TINY / "model.safetensors"))
    rounded = {}
    for name, w in dense.items():
        if name.endswith("_proj.weight"):
            w = w.float()
            scale = w.abs().amax(1, keepdim=True) / 448.0  # one scale per output channel
            rounded[name[: -len(".weight")]] = (w / scale).to(torch.float8_e4m3fn).float() * scale
    assert greedy(TINY, PROMPTS, quantization="fp8") == greedy(write_dense(tmp_path / "ref", rounded), PROMPTS)


def test_online_fp8_halves_weight_memory_against_bf16():
    llm = small_llm(TINY, dtype="bfloat16", quantization="fp8")
    mem = weight_memory(llm.engine.runner.model)
    # fp8 weights plus one float32 scale per output channel (3% of a 128-wide layer)
    assert mem.linear_bytes * 1.9 <= mem.linear_bf16_bytes


@pytest.mark.slow
def test_online_fp8_halves_the_default_models_linear_weights():
    llm = small_llm(dtype="bfloat16", quantization="fp8")
    mem = weight_memory(llm.engine.runner.model)
    assert mem.linear_bytes * 2 <= mem.linear_bf16_bytes * 1.01


def test_fp8_checkpoint_with_bf16_weights_is_refused_naming_the_tensor(tmp_path):
    fp8_checkpoint(tmp_path, "dynamic")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.v_proj.weight"
    tensors[name] = tensors[name].to(torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"v_proj\.weight.*bfloat16.*expects torch\.float8_e4m3fn"):
        small_llm(tmp_path, dtype="float32")


def test_static_fp8_checkpoint_missing_input_scales_is_refused(tmp_path):
    fp8_checkpoint(tmp_path, "static")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors.pop("model.layers.1.mlp.down_proj.input_scale")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing .*down_proj\.input_scale"):
        small_llm(tmp_path, dtype="float32")


def test_block_scales_of_the_wrong_shape_are_refused(tmp_path):
    fp8_checkpoint(tmp_path, "dynamic", (32, 64))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"down_proj\.weight_scale_inv.*\(4, 1\).*expects \(4, 4\)"):
        small_llm(tmp_path, dtype="float32")


def test_unknown_activation_scheme_is_refused(tmp_path):
    fp8_checkpoint(tmp_path, "dynamic")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["activation_scheme"] = "per-head"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="activation_scheme 'per-head' is not supported"):
        small_llm(tmp_path, dtype="float32")
