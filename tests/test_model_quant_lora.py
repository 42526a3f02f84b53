"""Dense architectures with a quantized checkpoint and with LoRA: a tiny random checkpoint of each (Qwen3, Gemma 2
and 3, OLMo 2, Granite, SmolLM3) written by transformers, quantized by contrib/quant-tools/quantize_rtn.py (GPTQ
4-bit, or AWQ for some), gives transformers' greedy tokens on the weights the tool dequantizes them to; a PEFT
adapter over every projection gives the tokens of PEFT's merged model. Phi-3's checkpoint stores qkv_proj and
gate_up_proj fused: quantized so (GPTQ and AWQ), pagoda splits the packed tensors, and its adapters target them.
What pagoda refuses (LoRA on Mixture-of-Experts models) is tested in test_moe_models.py."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lora_helpers import ALL_PROJECTIONS, hf_greedy, make_adapter
from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.modeling.default_model import ensure_default_model
from test_model_architectures import _config as architecture_config
from tiny_models import default_vocab_size

_spec = importlib.util.spec_from_file_location(
    "quantize_rtn", Path(__file__).parents[1] / "contrib" / "quant-tools" / "quantize_rtn.py")
rtn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rtn)

MAX_TOKENS = 10
PROMPTS = [[5, 17, 923, 4001, 77], list(range(100, 160, 3))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


ARCHITECTURES = ["qwen3", "gemma2", "gemma3", "olmo2", "granite", "smollm3"]
# checkpoint format and quantization group of each: every width a multiple of 8, AWQ's inputs of the group
FORMATS = {"qwen3": ("gptq", 32), "gemma2": ("gptq", 16), "gemma3": ("awq", 16), "olmo2": ("gptq", 32),
           "granite": ("awq", 32), "smollm3": ("gptq", 16)}


def _config(arch: str, vocab: int):
    if arch == "qwen3":  # GQA 4:2, head_dim 32 (not 64 / 4)
        return transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        max_position_embeddings=256, initializer_range=0.2,
                                        tie_word_embeddings=False)
    config = architecture_config(arch, vocab)
    config.intermediate_size = 96  # Gemma 2's 77 has no 4-bit packing
    return config


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    """(architecture, directory) of a tiny random checkpoint written by transformers (the shapes of
    test_model_architectures.py)."""
    arch, default_dir = request.param, ensure_default_model()
    vocab = default_vocab_size()
    torch.manual_seed(21)
    model = AutoModelForCausalLM.from_config(_config(arch, vocab), dtype=torch.float32).eval()
    for p in model.parameters():  # norms that matter: Gemma's (1 + w) off 1, the others around 1
        if p.dim() == 1:
            torch.nn.init.normal_(p, mean=0.0 if arch.startswith("gemma") else 1.0, std=0.3)
    out = tmp_path_factory.mktemp(arch)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, out / name)
    return arch, out


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _check_against_dequantized(src: Path, out: Path, label: str) -> None:
    """pagoda on the quantized checkpoint ``out`` gives transformers' tokens on ``src`` with the weights the tool
    dequantized, and the first step's log-probability."""
    dequant = load_file(str(out / "reference" / "dequant.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    with torch.no_grad():
        params = dict(reference.named_parameters())
        for name, weight in dequant.items():
            params[name].copy_(weight)
    reference.generation_config.eos_token_id = None
    llm = LLM(str(out), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, cpu_threads=1)
    model = llm.engine.runner.model
    assert model.layers[0].qkv_proj.int_bits == 4 and model.layers[1].down_proj.int_bits == 4  # not dense
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    with torch.no_grad():
        for prompt, got in zip(PROMPTS, outputs):
            ref = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                     do_sample=False, output_logits=True, return_dict_in_generate=True)
            ref_tokens = ref.sequences[0, len(prompt):].tolist()
            assert list(got.outputs[0].token_ids) == ref_tokens, label
            first = torch.log_softmax(ref.logits[0][0].float(), -1)[ref_tokens[0]].item()
            assert got.outputs[0].logprobs[0][ref_tokens[0]].logprob == pytest.approx(first, abs=2e-3)


def test_a_quantized_checkpoint_gives_the_tokens_of_its_dequantized_weights(checkpoint, tmp_path):
    arch, src = checkpoint
    fmt, group = FORMATS[arch]
    out = tmp_path / fmt
    rtn.main([str(out), "--src", str(src), "--group", str(group), "--format", fmt])
    assert len(load_file(str(out / "reference" / "dequant.safetensors"))) == 2 * 7  # every projection, not norms
    _check_against_dequantized(src, out, f"{arch} ({fmt})")


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory) -> Path:
    """Phi-4-mini's partial rotary factor; qkv_proj stacks 64 + 32 + 32 rows, gate_up_proj 96 + 96."""
    default_dir = ensure_default_model()
    vocab = default_vocab_size()
    config = transformers.Phi3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.75,
                                     max_position_embeddings=256, initializer_range=0.2, pad_token_id=0,
                                     eos_token_id=2)
    torch.manual_seed(8)
    base = tmp_path_factory.mktemp("phi3")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(base))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, base / name)
    return base


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_a_quantized_phi3_stores_its_fused_layers_quantized_and_pagoda_splits_them(phi3_dir, tmp_path, fmt):
    """GPTQ's qzeros and AWQ's qweight and qzeros pack 8 output channels per int32: each shard is cut at its
    words; GPTQ's g_idx is every shard's."""
    out = tmp_path / fmt
    rtn.main([str(out), "--src", str(phi3_dir), "--group", "32", "--format", fmt])
    quantized = load_file(str(out / "model.safetensors"))
    assert "model.layers.0.self_attn.qkv_proj.qweight" in quantized
    assert "model.layers.0.mlp.gate_up_proj.qweight" in quantized
    _check_against_dequantized(phi3_dir, out, f"phi3 ({fmt})")


@pytest.fixture(scope="module")
def adapter(checkpoint, tmp_path_factory):
    """A PEFT adapter of rank 8 over every projection, with PEFT's merged model's tokens and the base model's."""
    arch, base = checkpoint
    path = make_adapter(base, tmp_path_factory.mktemp(f"adapter-{arch}"), seed=3, r=8, targets=ALL_PROJECTIONS)
    return path, hf_greedy(base, path, PROMPTS, MAX_TOKENS), hf_greedy(base, None, PROMPTS, MAX_TOKENS)


def test_a_lora_adapter_gives_the_merged_models_tokens(checkpoint, adapter):
    """On the cpu LoRA backend; Qwen3 also on the torch one (the same adapters, another kernel)."""
    arch, base = checkpoint
    adapter, expected, base_expected = adapter
    assert expected != base_expected  # the adapter changes what the model says
    lora = LoRARequest(f"{arch}-adapter", 1, str(adapter))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS] * 2
    for lora_backend in ("torch", "cpu") if arch == "qwen3" else ("cpu",):
        llm = LLM(str(base), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, cpu_threads=1,
                  enable_lora=True, max_loras=1, max_lora_rank=8, lora_backend=lora_backend)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[lora, lora, None, None])
        # adapter and base rows in one batch
        assert _tokens(outputs) == expected + base_expected, f"{arch} on the {lora_backend} LoRA backend"


def test_a_lora_adapter_of_phi3s_fused_projections_gives_the_merged_models_tokens(phi3_dir, tmp_path_factory):
    base = phi3_dir
    adapter = make_adapter(base, tmp_path_factory.mktemp("phi3-adapter"), seed=4, r=8,
                           targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    expected = hf_greedy(base, adapter, PROMPTS, MAX_TOKENS)
    assert expected != hf_greedy(base, None, PROMPTS, MAX_TOKENS)
    llm = LLM(str(base), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, cpu_threads=1,
              enable_lora=True, max_loras=1, max_lora_rank=8)
    lora = LoRARequest("phi3-adapter", 1, str(adapter))
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False, lora_request=lora)
    assert _tokens(outputs) == expected
