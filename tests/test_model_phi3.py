"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``) against HF transformers: tiny random checkpoints that transformers
writes from ``Phi3Config`` (float32, fused ``qkv_proj`` and ``gate_up_proj`` tensors), loaded by pagoda from the
folder; greedy tokens identical and first-step log-probabilities close, for several shapes: a window that slides
over the prompts, LongRoPE on its short factors and on its long ones, Phi-4-mini's partial rotary factor and tied
embeddings, GQA ratios and odd sizes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from pagoda import LLM, SamplingParams
from pagoda.modeling.default_model import ensure_default_model
from pagoda.modeling.models.phi3 import Phi3ForCausalLM

MAX_TOKENS = 10


def _factors(n: int, start: float, step: float) -> list[float]:
    return [round(start + step * i, 3) for i in range(n)]


# case -> (Phi3Config keyword arguments, max_model_len, prompt lengths)
CASES = {
    # Phi-3-mini's shape in small: MHA, no RoPE scaling, a window of 8 over every layer, odd intermediate size
    "phi3-window": (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=77,
                         sliding_window=8), 128, (5, 20)),
    # Phi-3.5-mini's LongRoPE, served within original_max_position_embeddings: the short factors; GQA 3:1
    "phi3-longrope-short": (dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=64,
                                 original_max_position_embeddings=64,
                                 rope_scaling={"type": "longrope", "short_factor": _factors(8, 1.0, 0.15),
                                               "long_factor": _factors(8, 3.0, 0.5)}), 64, (5, 20)),
    # Phi-4-mini in small: 3/4 of each head rotated, tied embeddings, GQA 2:1, LongRoPE past its original length
    # (prompts longer than 16 tokens, where transformers switches to the long factors too)
    "phi4-mini-longrope-long": (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=96, partial_rotary_factor=0.75, tie_word_embeddings=True,
                                     original_max_position_embeddings=16,
                                     rope_scaling={"type": "longrope", "short_factor": _factors(6, 1.0, 0.1),
                                                   "long_factor": _factors(6, 2.0, 0.7)}), 128, (17, 30)),
}


@pytest.fixture(scope="module")
def default_dir():
    return ensure_default_model()


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory, default_dir):
    from transformers import AutoTokenizer

    case = request.param
    kwargs, max_model_len, prompt_lengths = CASES[case]
    vocab = len(AutoTokenizer.from_pretrained(str(default_dir)))
    config = transformers.Phi3Config(vocab_size=vocab, num_hidden_layers=2, max_position_embeddings=256,
                                     initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     **kwargs)
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    for p in model.parameters():  # norms that matter
        if p.dim() == 1:
            torch.nn.init.normal_(p, mean=1.0, std=0.3)
    out = tmp_path_factory.mktemp(case)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, out / name)
    model.generation_config.eos_token_id = None
    return case, out, model, max_model_len, prompt_lengths


def _hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), [torch.log_softmax(s[0].float(), -1) for s in out.logits]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_tokens_and_first_step_logprobs_match_transformers(checkpoint, backend):
    case, path, hf, max_model_len, prompt_lengths = checkpoint
    stored = json.loads((path / "config.json").read_text())
    assert "qkv_proj" in str(list(hf.state_dict())) and stored["architectures"] == ["Phi3ForCausalLM"]
    llm = LLM(model=str(path), dtype="float32", max_model_len=max_model_len, kv_cache_memory_bytes=4 << 20,
              cpu_threads=1, attention_backend=backend, block_size=16)
    prompts = [[(37 * i + 11 * n) % 40000 + 100 for i in range(n)] for n in prompt_lengths]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = _hf_greedy(hf, prompt, MAX_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"{case} on {backend}, a prompt of {len(prompt)} tokens"
        first = got.logprobs[0]  # the first step's top 5 and the chosen token
        assert len(first) >= 5
        for token_id, lp in first.items():
            assert lp.logprob == pytest.approx(ref_logprobs[0][token_id].item(), abs=2e-3), (case, token_id)
        mine = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
        ref = [lp[t].item() for lp, t in zip(ref_logprobs, ref_tokens)]
        assert mine == pytest.approx(ref, abs=2e-3), f"{case} on {backend}: log-probabilities"


def test_phi3_config_spellings_transformers_4_checkpoints_use():
    """A Phi-3-mini-128k config.json as published: LongRoPE named "su", original_max_position_embeddings at the
    top level (it wins over one inside rope_scaling), a window wider than the model (ignored), no head_dim."""
    cfg = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
           "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 32, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
           "rope_theta": 10000.0, "sliding_window": 262144, "rms_norm_eps": 1e-5, "hidden_act": "silu",
           "rope_scaling": {"type": "su", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48,
                            "original_max_position_embeddings": 2048}}
    spec = Phi3ForCausalLM.spec_from_hf(cfg)
    rope = spec.rope(0)
    assert rope.rope_type == "longrope"
    assert rope.scaling_dict["original_max_position_embeddings"] == 4096
    assert spec.head_dim == 96 and spec.sliding_windows == ()
    assert not spec.tie_word_embeddings and not spec.qkv_bias
    windowed = Phi3ForCausalLM.spec_from_hf({**cfg, "sliding_window": 2047, "max_position_embeddings": 4096,
                                             "rope_scaling": None})
    assert windowed.sliding_windows == (2047,) * 32 and windowed.rope(0).rope_type == "default"
