"""LoRA on a quantized base model: the adapter's terms are added to the quantized layers' outputs, so a GPTQ, AWQ
or int8 model with an adapter gives the greedy tokens of its dequantized weights in full precision with the same
adapter, beside base-model requests in the same batch. W8A8 (int8 activations too) is compared by log-probability,
as its own tests compare it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagoda import LoRARequest, SamplingParams
from pagoda.plugins.quant.int8 import quantize_rows
from lora_helpers import make_adapter
from quant_helpers import PROMPTS, TINY, awq_checkpoint, edit_checkpoint, gptq_checkpoint, small_llm, write_dense
from test_quant_int8 import MAX_LOGPROB_DRIFT, MEAN_LOGPROB_DRIFT, converted_tiny

NUM_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)


def int8_weight_only(root: Path) -> dict[str, torch.Tensor]:
    """llm-compressor's int8 checkpoint with float activations (W8A16): int8 weights, one scale per row."""
    path, ref = converted_tiny(root)
    edit_checkpoint(path, config_edit=lambda cfg: cfg["config_groups"]["group_0"].update(input_activations=None))
    path.rename(root / "q")
    return ref


BUILDERS = {
    "gptq": lambda root: gptq_checkpoint(root / "q", bits=4, group=32),
    "awq": lambda root: awq_checkpoint(root / "q", group=32),
    "int8": int8_weight_only,
}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    # every projection, large enough that the adapter changes the tiny model's greedy tokens
    return make_adapter(TINY, tmp_path_factory.mktemp("quant-lora") / "adapter", seed=21, r=8, alpha=16)


def lora_greedy(path: Path, adapter: Path, lora_backend: str) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt with the adapter and with the base model, all in one batch: (adapter tokens, base tokens)."""
    llm = small_llm(path, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8, lora_backend=lora_backend)
    lora = LoRARequest("quant-lora", 1, str(adapter))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in range(2)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[lora, None] * len(PROMPTS))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens[0::2], tokens[1::2]


@pytest.mark.parametrize("lora_backend", ["torch", "cpu"])
@pytest.mark.parametrize("fmt", list(BUILDERS))
def test_a_quantized_base_with_an_adapter_gives_the_greedy_tokens_of_its_dequantized_weights(tmp_path, adapter, fmt,
                                                                                           lora_backend):
    ref = BUILDERS[fmt](tmp_path)
    got_lora, got_base = lora_greedy(tmp_path / "q", adapter, lora_backend)
    want_lora, want_base = lora_greedy(write_dense(tmp_path / "dense", ref), adapter, lora_backend)
    assert got_base == want_base, f"{fmt}: the base-model requests beside the adapter's changed"
    assert got_lora == want_lora, f"{fmt} + LoRA diverged from the dequantized model + LoRA"
    assert got_lora != got_base, "the adapter left every greedy token as it was: the comparison proves nothing"


def prompt_logprobs(path: Path, lora: LoRARequest, **kwargs) -> torch.Tensor:
    llm = small_llm(path, dtype="float32", enable_lora=True, max_lora_rank=8, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False, lora_request=lora)
    return torch.tensor([d[t].logprob for o, p in zip(outs, PROMPTS) for d, t in zip(o.prompt_logprobs[1:], p[1:])])


def test_online_w8a8_with_an_adapter_scores_prompts_like_the_int8_rounded_dense_model_with_it(tmp_path, adapter):
    rounded = {}
    for name, w in load_file(str(TINY / "model.safetensors")).items():
        if name.endswith("_proj.weight"):
            q, scale = quantize_rows(w)
            rounded[name[: -len(".weight")]] = q.float() * scale[:, None]
    lora = LoRARequest("w8a8-lora", 1, str(adapter))
    got = prompt_logprobs(TINY, lora, quantization="int8")
    want = prompt_logprobs(write_dense(tmp_path / "ref", rounded), lora)
    drift = (got - want).abs()
    assert float(drift.max()) < MAX_LOGPROB_DRIFT and float(drift.mean()) < MEAN_LOGPROB_DRIFT
    moved = got - prompt_logprobs(TINY, None, quantization="int8")
    assert float(moved.abs().mean()) > 4 * MEAN_LOGPROB_DRIFT, "the adapter hardly moved the log-probabilities"
