"""Qwen3 with a quantized checkpoint and with LoRA: a tiny random Qwen3 written by transformers, quantized by
contrib/quant-tools/quantize_rtn.py (GPTQ 4-bit, group 32), gives transformers' greedy tokens on the weights the
tool dequantizes them to; a PEFT adapter over every projection gives the tokens of PEFT's merged model. Phi-3's
adapters target its fused qkv_proj and gate_up_proj themselves. What pagoda refuses (LoRA and quantized experts on
Mixture-of-Experts models) is tested in test_moe_models.py."""

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

_spec = importlib.util.spec_from_file_location(
    "quantize_rtn", Path(__file__).parents[1] / "contrib" / "quant-tools" / "quantize_rtn.py")
rtn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rtn)

MAX_TOKENS = 10
PROMPTS = [[5, 17, 923, 4001, 77], list(range(100, 160, 3))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    """GQA 4:2, head_dim 32 (not 64 / 4), every width a multiple of the quantization group of 32."""
    default_dir = ensure_default_model()
    vocab = len(transformers.AutoTokenizer.from_pretrained(str(default_dir)))
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(21)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for p in model.parameters():
        if p.dim() == 1:
            torch.nn.init.normal_(p, mean=1.0, std=0.3)
    out = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, out / name)
    return out


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_a_gptq_checkpoint_of_qwen3_gives_the_tokens_of_its_dequantized_weights(qwen3_dir, tmp_path):
    out = tmp_path / "gptq"
    rtn.main([str(out), "--src", str(qwen3_dir), "--group", "32"])
    dequant = load_file(str(out / "reference" / "dequant.safetensors"))
    assert len(dequant) == 2 * 7  # every projection of both layers (not the q/k norms)
    reference = AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32,
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
            assert list(got.outputs[0].token_ids) == ref_tokens
            first = torch.log_softmax(ref.logits[0][0].float(), -1)[ref_tokens[0]].item()
            assert got.outputs[0].logprobs[0][ref_tokens[0]].logprob == pytest.approx(first, abs=2e-3)


@pytest.fixture(scope="module")
def adapter(qwen3_dir, tmp_path_factory):
    """A PEFT adapter of rank 8 over every projection, with PEFT's merged model's tokens and the base model's."""
    path = make_adapter(qwen3_dir, tmp_path_factory.mktemp("adapter"), seed=3, r=8, targets=ALL_PROJECTIONS)
    return path, hf_greedy(qwen3_dir, path, PROMPTS, MAX_TOKENS), hf_greedy(qwen3_dir, None, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("lora_backend", ["torch", "cpu"])
def test_a_lora_adapter_on_qwen3_gives_the_merged_models_tokens(qwen3_dir, adapter, lora_backend):
    adapter, expected, base_expected = adapter
    assert expected != base_expected  # the adapter changes what the model says
    llm = LLM(str(qwen3_dir), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, cpu_threads=1,
              enable_lora=True, max_loras=1, max_lora_rank=8, lora_backend=lora_backend)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS] * 2
    lora = LoRARequest("qwen3-adapter", 1, str(adapter))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[lora, lora, None, None])
    assert _tokens(outputs) == expected + base_expected  # adapter and base rows in one batch


def test_a_lora_adapter_of_phi3s_fused_projections_gives_the_merged_models_tokens(tmp_path_factory):
    default_dir = ensure_default_model()
    vocab = len(transformers.AutoTokenizer.from_pretrained(str(default_dir)))
    config = transformers.Phi3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.75,
                                     max_position_embeddings=256, initializer_range=0.2, pad_token_id=0,
                                     eos_token_id=2)
    torch.manual_seed(8)
    base = tmp_path_factory.mktemp("phi3")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(base))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, base / name)
    adapter = make_adapter(base, tmp_path_factory.mktemp("phi3-adapter"), seed=4, r=8,
                           targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    expected = hf_greedy(base, adapter, PROMPTS, MAX_TOKENS)
    assert expected != hf_greedy(base, None, PROMPTS, MAX_TOKENS)
    llm = LLM(str(base), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, cpu_threads=1,
              enable_lora=True, max_loras=1, max_lora_rank=8)
    lora = LoRARequest("phi3-adapter", 1, str(adapter))
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False, lora_request=lora)
    assert _tokens(outputs) == expected
