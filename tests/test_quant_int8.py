"""int8 W8A8: online ``--quantization int8`` and compressed-tensors "int-quantized" checkpoints."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagoda.errors import CheckpointError, ConfigError
from pagoda.plugins.quant.compressed_tensors import CompressedTensorsConfig
from pagoda.plugins.quant.cpu_int8_kernel import int8_linear_reference
from pagoda.plugins.quant.int8 import Int8Config, quantize_rows, uses_int8_kernel
from pagoda.plugins.quant.memory import weight_memory
from pagoda.testing import check_quant_method
from quant_helpers import FUSED, PROMPTS, TINY, edit_checkpoint, greedy, small_llm, write_dense

_spec = importlib.util.spec_from_file_location(
    "convert_w8a8_int8", Path(__file__).parents[1] / "contrib" / "quant-tools" / "convert_w8a8_int8.py")
converter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(converter)


def checkpoint_tensors(out_features: int, in_features: int, gen: torch.Generator):
    """One output shard as llm-compressor's W8A8 stores it, and its dequantized weight."""
    w = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    q, scale = converter.quantize_channel(w)
    return {"weight": q, "weight_scale": scale}, q.float() * scale.float()


def tensor_scale_tensors(out_features: int, in_features: int, gen: torch.Generator):
    """The "tensor" strategy: one scale for the whole shard, stored as a scalar."""
    w = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    scale = (w.abs().max() / 127.5).reshape(())
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def w8a8_config(**edits) -> dict:
    cfg = converter.quantization_config()
    group = cfg["config_groups"]["group_0"]
    for key, value in edits.items():
        part, _, field = key.partition("__")
        if field:
            group[part][field] = value
        else:
            group[part] = value
    return cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_online_int8_passes_the_quant_method_conformance_kit(dtype):
    check_quant_method(Int8Config, None, dtype=dtype)


@pytest.mark.parametrize("edits,tensors", [({}, checkpoint_tensors), ({"input_activations": None}, checkpoint_tensors),
                                           ({"weights__strategy": "tensor"}, tensor_scale_tensors)],
                         ids=["w8a8", "w8a16", "w8a8-tensor-scale"])
def test_int_quantized_checkpoints_pass_the_conformance_kit_against_their_dequantized_weights(edits, tensors):
    # W8A8 is held to 1e-2 (relative): activations rounded to 1/127 of each token's largest value
    check_quant_method(CompressedTensorsConfig, w8a8_config(**edits), tensors)


def converted_tiny(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    reference = converter.convert(TINY, tmp_path / "w8a8")
    return tmp_path / "w8a8", {k[: -len(".weight")]: v for k, v in reference.items()}


def test_every_w8a8_linear_is_its_dequantized_weight_times_per_token_int8_activations(tmp_path):
    path, ref = converted_tiny(tmp_path)
    assert json.loads((path / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"
    model = small_llm(path, dtype="float32").engine.runner.model
    assert uses_int8_kernel(model)
    tensors = load_file(str(path / "model.safetensors"))
    x = torch.randn(5, 256) * torch.linspace(0.1, 3, 5)[:, None]
    for i, layer in enumerate(model.layers):
        for fused, modules in FUSED.items():
            linear = getattr(layer, fused)
            xin = x[:, : linear.in_features]
            weights = [ref[f"model.layers.{i}.{m}"] for m in modules]
            q = torch.cat([tensors[f"model.layers.{i}.{m}.weight"] for m in modules])
            scale = torch.cat([tensors[f"model.layers.{i}.{m}.weight_scale"] for m in modules]).float().squeeze(1)
            want = int8_linear_reference(xin, q, scale, None)
            torch.testing.assert_close(linear(xin), want, rtol=1e-6, atol=1e-6)
            # and within int8 activation rounding of the dequantized weight in float
            dense = xin @ torch.cat(weights).t()
            assert float((want - dense).norm() / dense.norm()) < 1e-2


def prompt_logprobs(path: Path, **kwargs) -> torch.Tensor:
    """Teacher-forced log-probabilities of every prompt token after the first, all of PROMPTS concatenated."""
    from pagoda import SamplingParams

    llm = small_llm(path, dtype="float32", **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    return torch.tensor([d[t].logprob for o, p in zip(outs, PROMPTS) for d, t in zip(o.prompt_logprobs[1:], p[1:])])


# The tiny random model's next-token distributions are nearly flat (its top two first tokens are 0.03 nats
# apart), so greedy tokens part at the first step under any change of arithmetic; log-probabilities are
# compared instead. Measured: W8A8 against its dequantized weights in float32 differs by at most 0.063
# nats (mean 0.023) over the 32 prompt positions, about what the weight rounding itself moves (0.055).
MAX_LOGPROB_DRIFT, MEAN_LOGPROB_DRIFT = 0.15, 0.05


def test_w8a8_checkpoint_scores_prompts_like_its_dequantized_weights_in_float(tmp_path):
    path, ref = converted_tiny(tmp_path)
    drift = (prompt_logprobs(path) - prompt_logprobs(write_dense(tmp_path / "dense", ref))).abs()
    assert float(drift.max()) < MAX_LOGPROB_DRIFT and float(drift.mean()) < MEAN_LOGPROB_DRIFT


def test_online_int8_scores_prompts_like_the_dense_model_with_int8_rounded_weights(tmp_path):
    rounded = {}
    for name, w in load_file(str(TINY / "model.safetensors")).items():
        if name.endswith("_proj.weight"):
            q, scale = quantize_rows(w)
            rounded[name[: -len(".weight")]] = q.float() * scale[:, None]
    drift = (prompt_logprobs(TINY, quantization="int8") - prompt_logprobs(write_dense(tmp_path / "ref", rounded))).abs()
    assert float(drift.max()) < MAX_LOGPROB_DRIFT and float(drift.mean()) < MEAN_LOGPROB_DRIFT


def test_online_int8_quarters_float32_linear_weights():
    llm = small_llm(TINY, dtype="float32", quantization="int8")
    mem = weight_memory(llm.engine.runner.model)
    # int8 codes plus a float32 scale and an int32 column sum per output row (6% of a 128-wide layer)
    assert mem.linear_bytes * 1.85 <= mem.linear_bf16_bytes


@pytest.mark.parametrize("edits,words", [
    ({"input_activations__symmetric": False}, "symmetric"),
    ({"input_activations__dynamic": False, "input_activations__strategy": "tensor"}, "dynamic"),
    ({"weights__strategy": "group", "weights__group_size": 64}, "strategy 'group'"),
    ({"weights__num_bits": 4}, "num_bits 8"),
])
def test_unsupported_int8_schemes_are_refused_saying_what_is_supported(tmp_path, edits, words):
    with pytest.raises(ConfigError, match=words):
        CompressedTensorsConfig(None, w8a8_config(**edits)).for_layer("model.layers.0.mlp.down_proj")


def test_nonzero_weight_zero_points_are_refused(tmp_path):
    path, _ = converted_tiny(tmp_path)

    def add_zero_points(tensors):
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            tensors[name.replace("weight_scale", "weight_zero_point")] = torch.full_like(tensors[name], 3).to(torch.int8)

    edit_checkpoint(path, add_zero_points)
    with pytest.raises(CheckpointError, match="weight_zero_point is not zero"):
        small_llm(path, dtype="float32")


def test_zero_weight_zero_points_load(tmp_path):
    path, _ = converted_tiny(tmp_path)

    def add_zero_points(tensors):
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            tensors[name.replace("weight_scale", "weight_zero_point")] = torch.zeros_like(tensors[name]).to(torch.int8)

    edit_checkpoint(path, add_zero_points)
    assert greedy(path, PROMPTS[:1], num_tokens=4) == greedy(converted_tiny(tmp_path / "b")[0], PROMPTS[:1], num_tokens=4)


def test_float_weights_in_an_int_quantized_checkpoint_are_refused_naming_the_tensor(tmp_path):
    path, _ = converted_tiny(tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"
    edit_checkpoint(path, lambda t: t.update({name: t[name].float()}))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + ".*torch.int8"):
        small_llm(path, dtype="float32")


def test_online_int8_on_a_quantized_checkpoint_is_refused(tmp_path):
    path, _ = converted_tiny(tmp_path)
    with pytest.raises(ConfigError, match="already quantized"):
        small_llm(path, dtype="float32", quantization="int8")


def test_the_benchmark_header_names_the_int8_kernels_isa_path():
    from pagoda.plugins.entrypoints.bench.throughput import kernel_isa_paths
    from pagoda.plugins.quant.cpu_int8_kernel import isa_path

    llm = small_llm(TINY, dtype="float32", quantization="int8")
    assert kernel_isa_paths(llm)["int8 linear"] == isa_path() != "torch"
