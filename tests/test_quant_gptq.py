"""GPTQ (AutoGPTQ / GPTQModel layout): bits, groups, act-order, v1 zero points, refusing bad checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pagoda.errors import CheckpointError, ConfigError
from quant_helpers import (
    DATA, PROMPTS, assert_linears_match, edit_checkpoint, fused_reference, gptq_checkpoint, greedy, small_llm, write_dense,
)

GPTQMODEL = DATA / "gptqmodel-g32-actorder"  # written by GPTQModel 7.7 (contrib/quant-tools/quantize_gptqmodel.py)

CASES = {
    "4bit-g32-v1": dict(bits=4, group=32),
    "4bit-g32-actorder": dict(bits=4, group=32, desc_act=True),
    "4bit-channel-asym-v2": dict(bits=4, group=-1, sym=False, checkpoint_format="gptq_v2"),
    "8bit-g64-actorder": dict(bits=8, group=64, desc_act=True),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def packed(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    ref = gptq_checkpoint(root / "q", **CASES[request.param])
    return root, ref


def test_every_gptq_linear_equals_its_dequantized_weight(packed):
    root, ref = packed
    model = small_llm(root / "q", dtype="float32").engine.runner.model
    assert_linears_match(model, ref)


def test_gptq_greedy_tokens_match_the_dequantized_model_in_full_precision(packed):
    root, ref = packed
    assert greedy(root / "q", PROMPTS) == greedy(write_dense(root / "dense", ref), PROMPTS)


def test_gptqmodel_checkpoint_generates_the_tokens_of_its_own_unpacking_in_transformers():
    expected = json.loads((GPTQMODEL / "reference" / "generations.json").read_text())
    assert greedy(GPTQMODEL, expected["prompts"]) == expected["outputs"]


def test_gptqmodel_checkpoint_layers_equal_gptqmodel_own_unpacking():
    ref = {k[: -len(".weight")]: v for k, v in load_file(str(GPTQMODEL / "reference" / "dequant.safetensors")).items()}
    model = small_llm(GPTQMODEL, dtype="float32").engine.runner.model
    assert model.layers[0].qkv_proj.int_parts[0][2], "desc_act: the input is read through a permutation"
    # GPTQModel's CPU kernel unpacks in fp16, so its reference carries fp16 rounding
    assert_linears_match(model, ref, rows=4, rtol=1e-3, atol=3e-3)


def test_act_order_shards_with_different_permutations_still_match(tmp_path):
    # q/k/v normally share one permutation (same input); a checkpoint where they do not must still be exact
    ref = gptq_checkpoint(tmp_path / "q", bits=4, group=32, desc_act=True, shared_perm=False)
    model = small_llm(tmp_path / "q", dtype="float32").engine.runner.model
    qkv = model.layers[0].qkv_proj
    assert len(qkv.int_parts) == 3
    x = torch.randn(3, 128)
    torch.testing.assert_close(qkv(x), x @ fused_reference(ref, 0, "qkv_proj").t(), rtol=1e-5, atol=1e-5)


def test_v1_zero_points_are_read_one_higher_than_stored(tmp_path):
    # the same quantized values, labelled v2 while stored as v1, must come out different by one zero step
    ref = gptq_checkpoint(tmp_path / "q", bits=4, group=32)
    cfg_path = tmp_path / "q" / "quantize_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["checkpoint_format"] = "gptq_v2"
    cfg_path.write_text(json.dumps(cfg))
    linear = small_llm(tmp_path / "q", dtype="float32").engine.runner.model.layers[0].o_proj
    x = torch.randn(2, 128)
    assert not torch.allclose(linear(x), x @ fused_reference(ref, 0, "o_proj").t(), atol=1e-3)


def _corrupt(tmp_path, edit=None, config_edit=None):
    gptq_checkpoint(tmp_path, bits=4, group=32, desc_act=True)
    return edit_checkpoint(tmp_path, edit, config_edit, config_file="quantize_config.json")


def test_gptq_scales_of_the_wrong_shape_are_refused_naming_the_tensor(tmp_path):
    name = "model.layers.0.mlp.down_proj.scales"

    def edit(t):
        t[name] = t[name][:4].contiguous()

    with pytest.raises(CheckpointError, match=r"down_proj\.scales.*\(4, 128\).*expects \(8, 128\)"):
        small_llm(_corrupt(tmp_path, edit), dtype="float32")


def test_gptq_missing_qzeros_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"missing .*qkv_proj\.qzeros#1"):
        small_llm(_corrupt(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.qzeros")), dtype="float32")


def test_act_order_checkpoint_without_g_idx_is_refused(tmp_path):
    def edit(t):
        for k in [k for k in t if k.endswith(".g_idx")]:
            t.pop(k)

    with pytest.raises(CheckpointError, match=r"missing .*g_idx"):
        small_llm(_corrupt(tmp_path, edit), dtype="float32")


def test_g_idx_that_breaks_the_group_size_is_refused_naming_the_tensor(tmp_path):
    name = "model.layers.0.self_attn.o_proj.g_idx"

    def edit(t):
        t[name] = torch.zeros_like(t[name])

    with pytest.raises(CheckpointError, match=r"o_proj\.g_idx.*does not assign 32 input columns to each group"):
        small_llm(_corrupt(tmp_path, edit), dtype="float32")


@pytest.mark.parametrize("field,value,message", [
    ("bits", 3, "bits=3 is not supported"),
    ("group_size", 100, "group_size 100 is not supported"),
    ("checkpoint_format", "marlin", "checkpoint_format 'marlin' is not supported"),
])
def test_unsupported_gptq_configs_are_refused(tmp_path, field, value, message):
    with pytest.raises(ConfigError, match=message):
        small_llm(_corrupt(tmp_path, config_edit=lambda c: c.update({field: value})), dtype="float32")
