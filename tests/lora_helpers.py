"""LoRA adapters made with PEFT for the tests, and the reference: HF transformers with PEFT's merged weights."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: Path, out_dir: Path, seed: int, r: int = 8, alpha: float = 16,
                 targets: Optional[list[str]] = None, use_rslora: bool = False, strength: float = 1.0) -> Path:
    """A PEFT LoRA adapter of ``base_dir`` with random A and B, saved into ``out_dir``: large enough
    (``strength``) that the adapter changes the model's greedy tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_PROJECTIONS, use_rslora=use_rslora,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:  # [r, in]: unit-sized projections of unit-sized activations
                param.copy_(torch.randn(param.shape, generator=gen) * strength / param.shape[1] ** 0.5)
            elif "lora_B" in name:  # [out, r]
                param.copy_(torch.randn(param.shape, generator=gen) * strength / param.shape[1] ** 0.5)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def hf_model(base_dir: Path, adapter_dir: Optional[Path]):
    """HF transformers' model of ``base_dir`` in float32 (eager attention), merged with the adapter (PEFT's
    ``merge_and_unload``) or alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, attn_implementation="eager")
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return model.eval()


def hf_greedy(base_dir: Path, adapter_dir: Optional[Path], prompts: list[list[int]], max_new_tokens: int
              ) -> list[list[int]]:
    """Greedy tokens of HF transformers, on the base model merged with the adapter or on the base model alone
    (:func:`hf_model`); no end-of-sequence token stops them."""
    model = hf_model(base_dir, adapter_dir)
    model.generation_config.eos_token_id = None
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
            results.append(out[0, len(ids):].tolist())
    return results


def hf_greedy_choices(base_dir: Path, adapter_dir: Optional[Path], prompts: list[list[int]],
                      tokens: list[list[int]]) -> list[list[int]]:
    """HF's greedy choice after each prompt and after each prefix of its ``tokens`` (:func:`hf_model`), from one
    forward pass over the prompt and the tokens (teacher forcing). Where they equal ``tokens``, the tokens are HF's
    greedy continuation, which :func:`hf_greedy` would find with a forward pass per token."""
    model = hf_model(base_dir, adapter_dir)
    choices = []
    with torch.inference_mode():
        for ids, new in zip(prompts, tokens):
            seq = ids + new[:-1]
            logits = model(torch.tensor([seq]), attention_mask=torch.ones(1, len(seq), dtype=torch.long),
                           logits_to_keep=len(new)).logits[0]  # [len(new), vocab]
            choices.append(logits.argmax(dim=-1).tolist())
    return choices
