"""The dense architectures beyond Llama with what the engine does around a model: prefix caching, chunked prefill
and recompute preemption in one run, on the torch reference backend and on the fused CPU path, and tensor
parallelism over 2 processes; each run gives transformers' greedy tokens (float32). One tiny random checkpoint per
architecture, written by transformers from its config class (the shapes of test_model_architectures.py, and a
Phi-4-mini-shaped Phi-3), and transformers' tokens computed once per architecture."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from pagoda import LLM, SamplingParams
from pagoda.modeling.default_model import ensure_default_model
from one_engine import release
from test_model_architectures import _config as architecture_config
from tiny_models import default_vocab_size

ARCHITECTURES = ["qwen3", "gemma2", "gemma3", "olmo2", "granite", "smollm3", "phi3"]
MAX_TOKENS = 8
rng = random.Random(3)
SHARED = [rng.randrange(1000, 30000) for _ in range(32)]  # two full blocks of 16, cached by the first prompt
PROMPTS = [SHARED + [rng.randrange(1000, 30000) for _ in range(k)] for k in (3, 9, 14, 21)]
# a pool of 7 blocks of 16 for 4 requests of 35-61 tokens: requests are preempted and recomputed; prompts longer
# than the 16-token step budget are prefilled in chunks; the later prompts find the shared prefix cached
COMPOSED = dict(enable_prefix_caching=True, num_gpu_blocks_override=7, max_num_batched_tokens=16, max_num_seqs=4,
                preemption_mode="recompute")


def _config(arch: str, vocab: int):
    if arch == "phi3":  # Phi-4-mini's partial rotary factor and tied embeddings, a window of 8, GQA 2:1
        return transformers.Phi3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.75,
                                       tie_word_embeddings=True, sliding_window=8, max_position_embeddings=256,
                                       initializer_range=0.2, pad_token_id=0, eos_token_id=2)
    if arch == "olmo2":  # one KV head, which two tensor-parallel ranks both hold
        return transformers.Olmo2Config(vocab_size=vocab, num_attention_heads=4, num_key_value_heads=1,
                                        hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        max_position_embeddings=256, initializer_range=0.2)
    return architecture_config(arch, vocab)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def reference(request, tmp_path_factory):
    """(architecture, checkpoint directory, transformers' greedy tokens for each of PROMPTS)."""
    arch, default_dir = request.param, ensure_default_model()
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(_config(arch, default_vocab_size()), dtype=torch.float32,
                                             attn_implementation="eager").eval()
    for p in model.parameters():  # norms off 1 (Gemma's 1 + w) and q/k norms that matter
        if p.dim() == 1:
            torch.nn.init.normal_(p, std=0.3)
    out = tmp_path_factory.mktemp(f"composed-{arch}")
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, out / name)
    model.generation_config.eos_token_id = None
    tokens = []
    with torch.no_grad():
        for prompt in PROMPTS:
            seq = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False)
            tokens.append(seq[0, len(prompt):].tolist())
    return arch, out, tokens


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)  # caches the shared prefix
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prefix_caching_chunked_prefill_and_preemption_keep_transformers_tokens(reference, backend):
    arch, path, expected = reference
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, cpu_threads=1, attention_backend=backend,
              block_size=16, **COMPOSED)
    try:
        assert _generate(llm) == expected, f"{arch} on {backend}"
        engine = llm.engine
        assert engine.kv_manager.stats.hits >= 32, f"{arch}: the shared prefix should come from the cache"
        assert engine.scheduler.num_preemptions > 0, f"{arch}: the small pool should preempt"
    finally:
        release(llm)


def test_two_tensor_parallel_ranks_keep_transformers_tokens(reference):
    """OLMo 2's RMSNorm of the whole q and k projections spans both ranks' heads: one all-reduce of each token's
    sums of squares, its single KV head's k counted once."""
    arch, path, expected = reference
    options = dict(model=str(path), dtype="float32", max_model_len=64, cpu_threads=1, block_size=16,
                   tensor_parallel_size=2, **COMPOSED)
    llm = LLM(**options)
    try:
        assert _generate(llm) == expected, f"{arch} over 2 ranks"
    finally:
        release(llm)
