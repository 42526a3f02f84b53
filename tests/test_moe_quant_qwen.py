"""GPTQ, AWQ and compressed-tensors Qwen2-MoE and Qwen3-MoE checkpoints: contrib/quant-tools/quantize_rtn.py
quantizes a tiny random checkpoint that transformers writes (attention, dense MLP, every routed expert and
Qwen2-MoE's shared expert; 4-bit groups, whose experts stay packed, in act-order too, and int8 with a scale per row,
whose experts stay int8), and pagoda's greedy tokens and first-step logprobs are transformers' on the tool's
dequantized weights (float32). A shared expert stored unquantized under a quant config that covers it is refused
with the tensor named and the way to mark it, and loads once marked."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

from pagoda import LLM, SamplingParams
from pagoda.errors import CheckpointError
from pagoda.host.env import HostConfig, resolve_host_config
from pagoda.modeling.layers.moe import FusedMoE
from pagoda.modeling.default_model import ensure_default_model
from moe_helpers import decoded_reference

MAX_TOKENS = 10
LOGPROB_ATOL = 2e-3
PROMPTS = [[5, 17, 923, 4001, 77], list(range(100, 340, 7))]
BASE = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, initializer_range=0.2)


def _config(arch: str, vocab_size: int):
    if arch == "qwen2_moe":  # a gated shared expert, un-normalized top-k, a dense second layer
        return Qwen2MoeConfig(vocab_size=vocab_size, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                              num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], **BASE)
    return Qwen3MoeConfig(vocab_size=vocab_size, moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                          norm_topk_prob=True, head_dim=32, **BASE)


def _rtn():
    spec = importlib.util.spec_from_file_location(
        "quantize_rtn", Path(__file__).parents[1] / "contrib" / "quant-tools" / "quantize_rtn.py")
    rtn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rtn)
    return rtn


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """arch -> directory of a random float32 checkpoint with the default model's tokenizer (written once)."""
    default_dir = ensure_default_model()
    vocab_size = len(json.loads((default_dir / "tokenizer.json").read_text())["model"]["vocab"])
    written = {}

    def write(arch: str) -> Path:
        if arch not in written:
            torch.manual_seed(7)
            model = AutoModelForCausalLM.from_config(_config(arch, vocab_size), dtype=torch.float32)
            out = tmp_path_factory.mktemp(arch)
            model.save_pretrained(str(out), safe_serialization=True)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(default_dir / name, out / name)
            written[arch] = out
        return written[arch]

    return write


def _quantized_bits(layer) -> int:
    """The bits a linear layer of pagoda's holds its weight in (GPTQ/AWQ/pack-quantized: ``int_bits``; int8)."""
    if getattr(layer, "int_bits", None) is not None:
        return layer.int_bits
    return 8 if type(layer.quant_method).__name__ == "Int8LinearMethod" else 0


@pytest.mark.parametrize("arch, fmt, bits, group, act_order", [
    (arch, fmt, 4, group, False) for fmt, group in (("gptq", 32), ("awq", 8)) for arch in ("qwen2_moe", "qwen3_moe")
] + [("qwen3_moe", "compressed", 4, 16, False), ("qwen2_moe", "compressed-int8", 8, None, False),
     ("qwen3_moe", "gptq", 8, None, False),
     # act-order: every expert projection's own column order; the down projections' last groups short (40 of 16)
     ("qwen3_moe", "gptq", 4, 16, True), ("qwen2_moe", "compressed", 4, 16, True)])
def test_a_quantized_qwen_moe_gives_the_tokens_of_its_dequantized_weights(dense, tmp_path, arch, fmt, bits, group,
                                                                          act_order):
    src = dense(arch)
    out = tmp_path / fmt
    dequant = _rtn().convert(src, out, bits, group or 32, fmt != "awq", fmt, channel=group is None,
                             act_order=act_order)
    num_sparse = 1 if arch == "qwen2_moe" else 2  # Qwen2-MoE's second layer is dense
    assert sum(".experts." in name for name in dequant) == num_sparse * 4 * 3  # every routed expert
    assert sum(".shared_expert." in name for name in dequant) == (3 if arch == "qwen2_moe" else 0)
    reference = decoded_reference(src, dequant, tmp_path / "dequantized")
    llm = LLM(model=str(out), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, cpu_threads=1)
    model = llm.engine.runner.model
    assert _quantized_bits(model.layers[0].qkv_proj) == bits
    if arch == "qwen2_moe":  # the dense layer's MLP and the shared expert run on the quantized kernels
        assert _quantized_bits(model.layers[1].gate_up_proj) == bits
        assert _quantized_bits(model.layers[0].moe.shared_expert.gate_up_proj) == bits
        assert _quantized_bits(model.layers[0].moe.shared_expert.down_proj) == bits
    experts = model.layers[0].moe.experts
    if group is None:  # int8 experts with a scale per row stay int8 in the MoE kernel
        assert experts.w13.dtype == torch.int8
    else:  # group-quantized experts stay packed, computed by the int kernel
        assert experts.w13 is None and experts.w13_q.dtype == torch.uint8 and experts.quant_method.bits == bits
        assert "packed experts" in experts.isa_path()
        assert hasattr(experts, "w13_perm") == act_order
        if act_order:  # the columns were sorted, each expert's own way
            natural = torch.arange(experts.hidden_size)
            assert not torch.equal(experts.w13_perm[0, 0], natural)
            assert not torch.equal(experts.w13_perm[0, 0], experts.w13_perm[1, 0])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, got in zip(PROMPTS, outputs):
        with torch.inference_mode():
            ref = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     do_sample=False, max_new_tokens=MAX_TOKENS, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=0)
        assert got.outputs[0].token_ids == ref.sequences[0, len(prompt):].tolist(), f"{arch} {fmt}: {len(prompt)}"
        ref_first = torch.log_softmax(ref.logits[0][0].float(), dim=-1)
        for tid, lp in got.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - float(ref_first[tid])) < LOGPROB_ATOL, (arch, fmt, tid)


def test_an_unquantized_shared_expert_under_a_quant_config_that_covers_it_is_named_with_the_way_out(dense, tmp_path):
    src = dense("qwen2_moe")
    out = tmp_path / "gptq"
    _rtn().convert(src, out, 4, 32, True, "gptq")
    # the shared expert as a checkpoint that left it in float writes it
    tensors = {k: v for k, v in load_file(str(out / "model.safetensors")).items() if ".shared_expert." not in k}
    tensors.update({k: v for k, v in load_file(str(src / "model.safetensors")).items() if ".shared_expert." in k})
    save_file(tensors, str(out / "model.safetensors"))
    options = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, cpu_threads=1)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.shared_expert\.\w+_proj\.weight.*"
                                              r"unquantized shared expert.*dynamic rule \"-:\.\*shared_expert\.\*\""):
        LLM(model=str(out), **options)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["dynamic"] = {"-:.*shared_expert.*": {}}
    (out / "config.json").write_text(json.dumps(config))
    shared = LLM(model=str(out), **options).engine.runner.model.layers[0].moe.shared_expert
    assert getattr(shared.gate_up_proj, "int_bits", None) is None and shared.gate_up_proj.weight.dtype == torch.float32


def test_a_compressed_expert_missing_its_scale_is_named(dense, tmp_path):
    src = dense("qwen3_moe")
    out = tmp_path / "compressed"
    _rtn().convert(src, out, 4, 16, True, "compressed")
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.down_proj.weight_scale"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"quantized expert 'model\.layers\.1\.mlp\.experts\.2\.down_proj' "
                                              r"\(compressed-tensors config_groups\.group_0, pack-quantized\) has no "
                                              r"weight_scale"):
        LLM(model=str(out), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, cpu_threads=1)


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "torch"])
def test_int8_experts_compute_what_their_dequantized_weights_compute(fused):
    """Int8 experts with row scales, through the C++ kernel and through torch, against the same experts held in
    float32 as ``q * scale``; odd sizes, 1 to 19 tokens, top-3 of 5."""
    torch.manual_seed(3)
    experts, hidden, inter, top_k = 5, 37, 23, 3
    host = resolve_host_config() if fused else HostConfig(fused_cpu_ops=False)
    int8 = FusedMoE(experts, hidden, inter, torch.float32, host=host, int8=True, prefix="l.experts")
    ref = FusedMoE(experts, hidden, inter, torch.float32, host=None, prefix="l.experts")
    for e in range(experts):
        for part, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            q = torch.randint(-127, 128, shape, dtype=torch.int8)
            scale = torch.rand(shape[0]) * 0.02 + 1e-3
            int8.load_expert(part, e, q, f"{part}{e}", scale=scale)
            ref.load_expert(part, e, q.float() * scale[:, None], f"{part}{e}")
    assert int8.w13.dtype == torch.int8 and not int8.missing()
    with pytest.raises(CheckpointError, match="holds int8 experts, but the tensor is torch.float32 without row"):
        int8.load_expert("gate", 0, torch.zeros(inter, hidden), "a float expert")
    for tokens in (1, 4, 19):
        x = torch.randn(tokens, hidden)
        weights, ids = torch.rand(tokens, top_k), torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
        torch.testing.assert_close(int8(x, weights, ids), ref(x, weights, ids), rtol=1e-4, atol=1e-4)
