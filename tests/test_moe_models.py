"""Mixture-of-Experts architectures against HF transformers: tiny random checkpoints written by transformers
itself from each architecture's config class (float32), loaded by pagoda like any checkpoint directory; greedy
tokens identical and first-step logprobs close, with a couple of shapes per architecture."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError
from pagoda.modeling.default_model import ensure_default_model

MAX_TOKENS = 12
LOGPROB_ATOL = 2e-3
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, initializer_range=0.2)


def _config(case: str, vocab_size: int):
    from transformers import GptOssConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if case == "mixtral-4x2":
        return MixtralConfig(vocab_size=vocab_size, intermediate_size=72, num_local_experts=4, num_experts_per_tok=2,
                             **BASE)
    if case == "mixtral-8x1-odd":  # top-1, odd expert size, one KV head
        return MixtralConfig(vocab_size=vocab_size, intermediate_size=37, num_local_experts=8, num_experts_per_tok=1,
                             **dict(BASE, num_key_value_heads=1))
    if case == "qwen2_moe":  # a shared expert with its gate, un-normalized top-k, a dense second layer
        return Qwen2MoeConfig(vocab_size=vocab_size, intermediate_size=48, moe_intermediate_size=24,
                              shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=2,
                              norm_topk_prob=False, mlp_only_layers=[1], **BASE)
    if case == "qwen2_moe-tp":  # odd expert and shared-expert sizes, split unevenly over two ranks
        return Qwen2MoeConfig(vocab_size=vocab_size, intermediate_size=48, moe_intermediate_size=33,
                              shared_expert_intermediate_size=27, num_experts=4, num_experts_per_tok=2,
                              norm_topk_prob=True, **BASE)
    if case == "qwen3_moe":  # normalized top-k, head_dim not hidden / heads, odd expert size
        return Qwen3MoeConfig(vocab_size=vocab_size, intermediate_size=48, moe_intermediate_size=33, num_experts=8,
                              num_experts_per_tok=2, norm_topk_prob=True, head_dim=32, **BASE)
    if case == "gpt_oss":  # a window of 8 tokens that slides over the prompts, sinks, YaRN, clamped SwiGLU
        return GptOssConfig(vocab_size=vocab_size, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2,
                            head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                            **BASE)
    raise ValueError(case)


CASES = ["mixtral-4x2", "mixtral-8x1-odd", "qwen2_moe", "qwen3_moe", "gpt_oss"]


@pytest.fixture(scope="module")
def default_dir():
    return ensure_default_model()


@pytest.fixture(scope="module")
def write_checkpoint(tmp_path_factory, default_dir):
    """case -> (directory, HF model) of a random-weight checkpoint with the default model's tokenizer, written
    once per module."""
    tokenizer = AutoTokenizer.from_pretrained(str(default_dir))
    written = {}

    def write(case: str):
        if case in written:
            return written[case]
        torch.manual_seed(1234)
        # eager experts: transformers' grouped GEMM refuses the odd expert sizes
        model = AutoModelForCausalLM.from_config(_config(case, len(tokenizer)), dtype=torch.float32,
                                                 attn_implementation="eager", experts_implementation="eager").eval()
        with torch.no_grad():  # make the biases, sinks and the clamp matter
            for name, param in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    torch.nn.init.normal_(param, std=0.5)
                if case == "gpt_oss" and "experts.gate_up_proj" in name and not name.endswith("bias"):
                    param.mul_(8)
        out_dir = tmp_path_factory.mktemp(case)
        model.save_pretrained(str(out_dir), safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(default_dir / name, out_dir / name)
        model.generation_config.eos_token_id = None
        written[case] = out_dir, model
        return written[case]

    return write


def hf_greedy(model, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=MAX_TOKENS, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt_ids):].tolist(), torch.log_softmax(out.logits[0][0].float(), dim=-1)


PROMPTS = [[5, 17, 923, 4001, 77], list(range(100, 400, 7))]  # 5 tokens; 43 tokens (several KV blocks)


# every architecture through the C++ kernel; two also through the torch path (--no-fused-cpu-ops)
RUNS = [(case, True) for case in CASES] + [("mixtral-4x2", False), ("gpt_oss", False)]


@pytest.mark.parametrize("case, fused", RUNS, ids=[f"{c}-{'kernel' if f else 'torch'}" for c, f in RUNS])
def test_moe_checkpoints_match_hf_greedy_tokens_and_first_logprobs(write_checkpoint, case, fused):
    ckpt_dir, hf = write_checkpoint(case)
    llm = LLM(model=str(ckpt_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20,
              cpu_threads=1, fused_cpu_ops=fused)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ref_ids, ref_first = hf_greedy(hf, prompt)
        got = out.outputs[0]
        assert got.token_ids == ref_ids, f"{case}: a prompt of {len(prompt)} tokens diverged from HF"
        for tid, lp in got.logprobs[0].items():
            assert abs(lp.logprob - float(ref_first[tid])) < LOGPROB_ATOL, (case, tid)


@pytest.mark.parametrize("options, message", [
    (dict(enable_lora=True, max_loras=1, max_lora_rank=8), "supports_lora = False.*--enable-lora"),
    (dict(quantization="int8"), "loads GPTQ, AWQ, compressed-tensors, FP8 and MXFP4 Mixture-of-Experts checkpoints, "
                                "not Int8Config.*unquantized"),
    (dict(quantization="fp8"), r"online FP8 \(--quantization fp8\) quantizes linear layers, not a Mixture-of-Experts "
                               "model's experts"),
])
def test_lora_and_online_quantization_of_a_moe_model_are_refused_at_start_up(write_checkpoint, options, message):
    ckpt_dir, _ = write_checkpoint("mixtral-4x2")
    with pytest.raises(ConfigError, match=message):
        LLM(model=str(ckpt_dir), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, cpu_threads=1,
            **options)


@pytest.mark.parametrize("fmt, group", [("gptq", 32), ("awq", 8)])
def test_a_quantized_mixtral_gives_the_tokens_of_its_dequantized_weights(write_checkpoint, tmp_path, fmt, group):
    """contrib/quant-tools/quantize_rtn.py quantizes the attention and every expert (4-bit; GPTQ's group of 32
    leaves the down projections' 72 inputs a short last group); transformers on the checkpoint with the tool's
    dequantized weights is the reference."""
    import importlib.util
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    spec = importlib.util.spec_from_file_location(
        "quantize_rtn", Path(__file__).parents[1] / "contrib" / "quant-tools" / "quantize_rtn.py")
    rtn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rtn)
    ckpt_dir, _ = write_checkpoint("mixtral-4x2")
    out = tmp_path / fmt
    rtn.main([str(out), "--src", str(ckpt_dir), "--group", str(group), "--format", fmt])
    dequant = load_file(str(out / "reference" / "dequant.safetensors"))
    assert sum(".experts." in name for name in dequant) == 2 * 4 * 3  # every expert's three projections
    reference_dir = tmp_path / "dequantized"
    reference_dir.mkdir()
    shutil.copy(ckpt_dir / "config.json", reference_dir / "config.json")
    save_file({**load_file(str(ckpt_dir / "model.safetensors")), **dequant}, str(reference_dir / "model.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(str(reference_dir), dtype=torch.float32,
                                                     attn_implementation="eager", experts_implementation="eager")
    reference.eval().generation_config.eos_token_id = None
    llm = LLM(model=str(out), dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20, cpu_threads=1)
    assert llm.engine.runner.model.layers[0].qkv_proj.int_bits == 4  # the attention runs quantized
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, got in zip(PROMPTS, outputs):
        ref_ids, ref_first = hf_greedy(reference, prompt)
        assert got.outputs[0].token_ids == ref_ids, f"{fmt}: a prompt of {len(prompt)} tokens"
        for tid, lp in got.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - float(ref_first[tid])) < LOGPROB_ATOL, (fmt, tid)


@pytest.mark.slow  # two worker processes: 20 s on an idle machine
def test_experts_split_over_two_tensor_parallel_ranks_match_hf(write_checkpoint):
    """Each rank holds half of every expert's intermediate dimension (33: 16 and 17 rows) and half of the
    shared expert; the ranks' sums give HF's tokens."""
    ckpt_dir, hf = write_checkpoint("qwen2_moe-tp")
    llm = LLM(model=str(ckpt_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20,
              tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outputs):
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt)[0]
    finally:
        llm.engine.shutdown()



def test_a_bf16_qwen3_moe_through_the_kernel_gives_hf_bf16_first_logprobs(write_checkpoint):
    # bf16 experts on bf16 activations: bf16 dot products on a CPU with bf16 math, widened weights elsewhere. Greedy
    # tokens are not compared: in bf16 this random model's near-ties split HF from every pagoda path (the torch
    # path's included) within 12 tokens on some prompt, and on the first token on AVX2; the first-step logprobs of
    # every path were within 0.035 of HF's (Zen 5)
    ckpt_dir, _ = write_checkpoint("qwen3_moe")
    hf_bf16 = AutoModelForCausalLM.from_pretrained(str(ckpt_dir), dtype=torch.bfloat16, attn_implementation="eager",
                                                   experts_implementation="eager").eval()
    hf_bf16.generation_config.eos_token_id = None
    llm = LLM(model=str(ckpt_dir), dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=8 << 20, cpu_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        _, ref_first = hf_greedy(hf_bf16, prompt)
        for tid, lp in out.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - float(ref_first[tid])) < 0.05, (len(prompt), tid)
