"""Dense architectures beyond the Llama family against HF transformers: tiny random-weight checkpoints that
transformers writes from each architecture's own config class (float32), loaded by pagoda from the folder;
greedy tokens identical, on the torch reference backend and the cpu backend. Windows shorter than the prompts,
so sliding-window layers really slide."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError
from pagoda.modeling.default_model import ensure_default_model
from tiny_models import default_vocab_size

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
            initializer_range=0.2)


def _config(arch: str, vocab: int):
    if arch == "qwen3":  # GQA 4:2, head_dim 32 (not 64 / 4)
        return transformers.Qwen3Config(vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        tie_word_embeddings=False, **BASE)
    if arch == "gemma2":  # window 8 on layer 0, soft-capped attention and logits, MQA, odd intermediate
        return transformers.Gemma2Config(vocab_size=vocab, num_attention_heads=2, num_key_value_heads=1, head_dim=24,
                                         sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                         query_pre_attn_scalar=20, **dict(BASE, intermediate_size=77))
    if arch == "gemma3":  # local RoPE and window on layer 0, global layer 1, q/k norms
        return transformers.Gemma3TextConfig(vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=16, sliding_window=8,
                                             layer_types=["sliding_attention", "full_attention"], **BASE)
    if arch == "olmo2":  # norms after the blocks, q/k norms over the whole projections
        return transformers.Olmo2Config(vocab_size=vocab, num_attention_heads=4, num_key_value_heads=4, **BASE)
    if arch == "granite":  # the four multipliers
        return transformers.GraniteConfig(vocab_size=vocab, num_attention_heads=4, num_key_value_heads=1,
                                          embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5,
                                          logits_scaling=2.0, **BASE)
    if arch == "smollm3":  # layer 1 without RoPE
        return transformers.SmolLM3Config(vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2,
                                          no_rope_layers=[1, 0], pad_token_id=0, **BASE)
    raise ValueError(arch)


@pytest.fixture(scope="module")
def default_dir():
    return ensure_default_model()


@pytest.fixture(scope="module", params=["qwen3", "gemma2", "gemma3", "olmo2", "granite", "smollm3"])
def checkpoint(request, tmp_path_factory, default_dir):
    arch = request.param
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(_config(arch, default_vocab_size()), dtype=torch.float32,
                                             attn_implementation="eager").eval()
    for p in model.parameters():  # norms off 1 (Gemma's 1 + w) and q/k norms that matter
        if p.dim() == 1:
            torch.nn.init.normal_(p, std=0.3)
    out = tmp_path_factory.mktemp(f"tiny-{arch}")
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, out / name)
    model.generation_config.eos_token_id = None
    return arch, out, model


def _hf_greedy(model, ids, n):
    """transformers' greedy tokens and the log-probability of each."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_tokens_match_transformers(checkpoint, backend):
    arch, path, hf = checkpoint
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20, cpu_threads=1,
              attention_backend=backend, block_size=16)
    prompts = [[5, 17, 923, 4001, 77], list(range(100, 160, 3))]  # 5 and 20 tokens: the window of 8 slides
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = _hf_greedy(hf, prompt, 12)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"{arch} on {backend}: {len(prompt)} tokens"
        mine = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
        assert mine == pytest.approx(ref_logprobs, abs=2e-3), f"{arch} on {backend}: log-probabilities"


def test_unsupported_rope_type_fails_naming_the_field(tmp_path):
    import json

    from pagoda.modeling.layers.rotary import RopeSpec, inv_freq_and_scale

    with pytest.raises(ConfigError, match="rope_scaling: rope type 'mrope'"):
        inv_freq_and_scale(RopeSpec.of(10000.0, {"rope_type": "mrope"}), 16, 128)
    del json, tmp_path
