"""gpt-oss as it is published: experts in MXFP4 (``quant_method: mxfp4``, ``*_blocks`` / ``*_scales``),
everything else bf16. A tiny random gpt-oss that transformers writes gets its experts rounded to MXFP4 here;
pagoda loads that checkpoint, keeps the experts packed (half a byte per weight and a byte per 32), and gives
the greedy tokens, and first-step log-probabilities within 2e-3, of transformers running the experts that
transformers' own MXFP4 conversion decodes (float32), on this CPU's kernel path and on its AVX2 build, and
over two tensor-parallel ranks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from pagoda import LLM, SamplingParams
from pagoda.errors import CheckpointError, ConfigError
from pagoda.host.cpu_isa import LEVELS
from pagoda.host.cpu_isa import cpu_isa as detected_isa
from pagoda.modeling.default_model import ensure_default_model

MAX_TOKENS = 10
LOGPROB_ATOL = 2e-3
PROMPTS = [[5, 17, 923, 4001, 77], list(range(100, 340, 7))]
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, out, in]`` rounded to MXFP4: blocks uint8 ``[E, out, in / 32, 16]`` (low nibble first), scales
    uint8 ``[E, out, in / 32]`` (a power of two per 32 columns, biased by 127)."""
    e, out, cols = w.shape
    v = w.float().reshape(e, out, cols // 32, 32)
    amax = v.abs().amax(-1).clamp(min=2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # |v| / 2**exponent <= 6
    scaled = v / torch.pow(2.0, exponent)[..., None]
    index = (scaled.abs()[..., None] - FP4).abs().argmin(-1)  # nearest magnitude
    codes = (index | (scaled < 0).long() << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(MXFP4 checkpoint directory, transformers on the experts its own conversion decodes)."""
    default_dir = ensure_default_model()
    vocab_size = len(json.loads((default_dir / "tokenizer.json").read_text())["model"]["vocab"])
    config = GptOssConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                          max_position_embeddings=512, initializer_range=0.2)
    torch.manual_seed(99)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager").eval()
    tensors = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                torch.nn.init.normal_(param, std=0.5)
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                if name.endswith("gate_up_proj"):
                    param.mul_(8)  # make the SwiGLU clamp matter
                blocks, scales = to_mxfp4(param.transpose(1, 2))  # stored [E, out, in]
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))  # transformers' decoding
    out = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    model.save_pretrained(str(out), safe_serialization=True)
    saved = load_file(str(out / "model.safetensors"))
    saved = {k: v for k, v in saved.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**saved, **tensors}, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, out / name)
    model.generation_config.eos_token_id = None
    return out, model


@pytest.mark.parametrize("cpu_isa, ranks", [
    ("auto", 1), ("avx2", 1),
    ("auto", 2),  # each rank holds 32 of every expert's 64 intermediate rows, and one block of the down inputs
], ids=["this-cpu", "avx2", "two-tensor-parallel-ranks"])
def test_an_mxfp4_gpt_oss_gives_the_tokens_of_its_decoded_experts(checkpoints, cpu_isa, ranks):
    if cpu_isa != "auto" and LEVELS.index(detected_isa("auto")) < LEVELS.index(cpu_isa):
        pytest.skip(f"the {cpu_isa} path needs a {cpu_isa} CPU")
    out, reference = checkpoints
    llm = LLM(model=str(out), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20,
              cpu_threads=1 if ranks == 1 else None, cpu_isa=cpu_isa, tensor_parallel_size=ranks)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, got in zip(PROMPTS, outputs):
        with torch.inference_mode():
            ref = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     do_sample=False, max_new_tokens=MAX_TOKENS, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=0)
        assert got.outputs[0].token_ids == ref.sequences[0, len(prompt):].tolist(), f"a prompt of {len(prompt)}"
        ref_first = torch.log_softmax(ref.logits[0][0].float(), dim=-1)
        for tid, lp in got.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - float(ref_first[tid])) < LOGPROB_ATOL, tid
    experts = llm.engine.runner.model.experts_of(0)
    assert experts.w13 is None and not experts.missing()
    assert experts.w13_q.dtype == experts.w13_scales.dtype == torch.uint8
    assert experts.isa_path().startswith(f"MXFP4 packed experts, {'avx2' if cpu_isa == 'avx2' else ''}")
    weights = 3 * 64 * 64 // ranks  # gate, up and down of hidden 64, intermediate 64, on this rank
    assert experts.expert_bytes() == weights // 2 + weights // 32  # float32 experts would take 4 bytes a weight
    llm.engine.shutdown()


def test_mxfp4_blocks_without_their_scales_are_named(checkpoints, tmp_path):
    out, _ = checkpoints
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"MXFP4 tensors without their other half.*layers\.1.*down_proj_blocks"):
        LLM(model=str(broken), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, cpu_threads=1)


def test_mxfp4_is_not_an_online_quantization():
    with pytest.raises(ConfigError, match="does not quantize a dense checkpoint while loading: drop --quantization"):
        LLM(model=str(ensure_default_model()), quantization="mxfp4", max_model_len=128, kv_cache_memory_bytes=4 << 20)
