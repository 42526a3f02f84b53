"""Greedy tokens of a reference runtime (a transformers model) for the three fixed prompts, with margins.

Used by every quantize_*.py script (each in its own venv; this file imports only torch and transformers).
``reference/generations.json`` holds ``prompts`` and ``outputs`` (token ids) and ``top2``: for every
generated token, the two best token ids and their logits, so a runtime that parts from the reference
can tell a near-tie (a small top-2 margin) from a real difference. ``REFERENCE_TOKENS=N`` in the
environment generates N tokens per prompt instead of 16.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

TEXTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


def prompts_for(tokenizer_dir: Path, vocab_size: int) -> list[list[int]]:
    """Three prompts: real text for a real tokenizer, random token ids for the tiny test model."""
    if vocab_size > 1000:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        return [tokenizer(t)["input_ids"] for t in TEXTS]
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (5, 11, 23)]


def write_reference_generations(model, out: Path, tokenizer_dir: Path) -> None:
    """Greedy ``REFERENCE_TOKENS`` (16) per prompt, EOS not allowed to stop them -> reference/generations.json."""
    num_tokens = int(os.environ.get("REFERENCE_TOKENS", "16"))
    prompts = prompts_for(tokenizer_dir, model.config.vocab_size)
    outputs, top2 = [], []
    for ids in prompts:
        with torch.no_grad():
            res = model.generate(torch.tensor([ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
        outputs.append(res.sequences[0, len(ids):].tolist())
        # res.logits: one [1, vocab] tensor per generated token, before min_new_tokens masks eos
        best = [step[0].float().topk(2) for step in res.logits]
        top2.append([[b.indices.tolist(), b.values.tolist()] for b in best])
    (out / "reference").mkdir(exist_ok=True)
    (out / "reference" / "generations.json").write_text(
        json.dumps({"prompts": prompts, "outputs": outputs, "top2": top2}))
