"""AWQ (AutoAWQ GEMM layout): loading, per-layer equality, greedy tokens, refusing bad checkpoints."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from pagoda.errors import CheckpointError, ConfigError
from quant_helpers import (
    DATA, PROMPTS, assert_linears_match, awq_checkpoint, edit_checkpoint, greedy, small_llm, write_dense,
)

AUTOAWQ = DATA / "awq-g64"  # written by AutoAWQ 0.2.9 (contrib/quant-tools/quantize_awq.py)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("awq")
    ref = awq_checkpoint(root / "q", group=32)
    return root, ref


def model_of(llm):
    return llm.engine.runner.model


def test_every_awq_linear_equals_its_dequantized_weight(packed):
    root, ref = packed
    model = model_of(small_llm(root / "q", dtype="float32"))
    assert_linears_match(model, ref)


def test_awq_greedy_tokens_match_the_dequantized_model_in_full_precision(packed):
    root, ref = packed
    dense = write_dense(root / "dense", ref)
    assert greedy(root / "q", PROMPTS) == greedy(dense, PROMPTS)


def test_awq_config_is_read_from_autoawq_quant_config_json(tmp_path):
    ref = awq_checkpoint(tmp_path / "q", group=64, quant_file="quant_config.json")
    assert "quantization_config" not in json.loads((tmp_path / "q" / "config.json").read_text())
    assert greedy(tmp_path / "q", PROMPTS[:1]) == greedy(write_dense(tmp_path / "dense", ref), PROMPTS[:1])


def test_autoawq_checkpoint_layers_equal_autoawq_own_unpacking():
    reference = load_file(str(AUTOAWQ / "reference" / "dequant.safetensors"))
    ref = {k[: -len(".weight")]: v for k, v in reference.items()}
    model = model_of(small_llm(AUTOAWQ, dtype="float32"))
    assert_linears_match(model, ref, rows=4)


def test_autoawq_checkpoint_generates_the_tokens_of_its_dense_reference_in_transformers():
    expected = json.loads((AUTOAWQ / "reference" / "generations.json").read_text())
    assert greedy(AUTOAWQ, expected["prompts"]) == expected["outputs"]


def test_awq_weights_take_at_least_three_times_less_memory_than_bf16():
    from pagoda.plugins.quant.memory import weight_memory

    mem = weight_memory(model_of(small_llm(AUTOAWQ, dtype="bfloat16")))
    assert mem.linear_bf16_bytes >= 3 * mem.linear_bytes


def _corrupt(tmp_path, edit, config_edit=None):
    awq_checkpoint(tmp_path, group=32)
    return edit_checkpoint(tmp_path, edit, config_edit)


def test_awq_qweight_of_the_wrong_shape_is_refused_naming_the_tensor(tmp_path):
    name = "model.layers.1.self_attn.k_proj.qweight"

    def edit(t):
        t[name] = t[name][:, :4].contiguous()

    with pytest.raises(CheckpointError, match=r"k_proj\.qweight.*\(128, 4\).*expects \(128, 8\)"):
        small_llm(_corrupt(tmp_path, edit), dtype="float32")


def test_awq_checkpoint_missing_scales_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"missing .*layers\.0\.o_proj\.scales"):
        small_llm(_corrupt(tmp_path, lambda t: t.pop("model.layers.0.self_attn.o_proj.scales")), dtype="float32")


def test_awq_float_qweight_is_refused_naming_its_dtype(tmp_path):
    name = "model.layers.0.mlp.up_proj.qweight"

    def edit(t):
        t[name] = t[name].float()

    with pytest.raises(CheckpointError, match=r"up_proj\.qweight.*float32.*expects torch\.int32"):
        small_llm(_corrupt(tmp_path, edit), dtype="float32")


@pytest.mark.parametrize("field,value,message", [
    ("bits", 3, "bits=3 is not supported"),
    ("group_size", 48, "group_size 48 is not supported"),
    ("version", "gemv", "version 'gemv' is not supported"),
])
def test_unsupported_awq_configs_are_refused(tmp_path, field, value, message):
    path = _corrupt(tmp_path, lambda t: None, lambda c: c.update({field: value}))
    with pytest.raises(ConfigError, match=message):
        small_llm(path, dtype="float32")


def test_awq_group_size_that_does_not_divide_a_layer_is_refused(tmp_path):
    path = _corrupt(tmp_path, lambda t: None, lambda c: c.update({"group_size": 512}))
    with pytest.raises(ConfigError, match=r"in_features \(128\) divisible by group_size 512"):
        small_llm(path, dtype="float32")
