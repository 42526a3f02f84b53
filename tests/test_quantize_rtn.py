"""contrib/quant-tools/quantize_rtn.py writes GPTQ / AWQ checkpoints that pagoda loads as the tool dequantizes them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quant_helpers import assert_linears_match, small_llm
from tiny_models import write_tiny_llama

_spec = importlib.util.spec_from_file_location(
    "quantize_rtn", Path(__file__).parents[1] / "contrib" / "quant-tools" / "quantize_rtn.py")
rtn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rtn)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dense")
    write_tiny_llama(path)
    return path


@pytest.mark.parametrize("args,quant_method,bits", [
    (["--group", "32"], "gptq", 4),
    (["--group", "16", "--asym"], "gptq", 4),
    (["--bits", "8", "--group", "64", "--asym"], "gptq", 8),
    (["--format", "awq", "--group", "32"], "awq", 4),
], ids=["gptq4-sym-g32", "gptq4-asym-g16", "gptq8-asym-g64", "awq4-g32"])
def test_rtn_checkpoint_loads_with_every_linear_equal_to_the_tools_dequantization(dense, tmp_path, args,
                                                                                  quant_method, bits):
    out = tmp_path / "q"
    rtn.main([str(out), "--src", str(dense), *args])
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["bits"]) == (quant_method, bits)
    ref = {k[: -len(".weight")]: v for k, v in load_file(str(out / "reference" / "dequant.safetensors")).items()}
    assert len(ref) == 2 * 7  # every linear of both layers, nothing else
    model = small_llm(out, dtype="float32").engine.runner.model
    assert model.layers[0].gate_up_proj.int_bits == bits  # quantized, not loaded as dense
    assert_linears_match(model, ref)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_rtn_weights_stay_within_one_step_of_the_dense_ones(bits, sym):
    # 100 columns: the last group of 32 is short
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(24, 100, generator=gen) * torch.rand(24, 1, generator=gen)
    q, scales, zeros = rtn.quantize_rtn(w, bits, 32, sym)
    assert q.min() >= 0 and q.max() < 1 << bits and scales.shape == (24, 4)
    step = scales.float().repeat_interleave(32, 1)[:, :100]
    err = (rtn.dequantize(q, scales, zeros, torch.arange(w.shape[1]) // 32) - w).abs()
    # rounding is half a step; at a group's extremes a clamp can add another half: symmetric grids lack the
    # top value (zero point 2**(bits-1)), asymmetric ones round their zero point to an integer
    assert (err <= step * (1 + 1e-3) + 1e-6).all()
    assert err.mean() < 0.3 * step.mean()
