"""A tiny random Llama that can think: the default model's tokenizer with ``<think>`` and ``</think>`` added as
tokens (single ids, as in Qwen3's and DeepSeek-R1's vocabularies) and a Qwen3-style chat template whose
generation prompt opens the thinking, or closes an empty thinking block with ``enable_thinking`` false."""

from __future__ import annotations

import json
from pathlib import Path

from pagoda.modeling.default_model import ensure_default_model
from tiny_models import write_tiny_llama

THINKING_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
VOCAB = 49216  # the default model's 49152 ids and the two tags, rounded up


def write_tiny_thinker(model_dir: Path, seed: int = 0) -> Path:
    """The checkpoint directory (created), with random weights in real safetensors files."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    tokenizer_dir = model_dir / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    tokenizer.add_tokens(["<think>", "</think>"])  # added, not special (kept in decoded text), as in Qwen3's
    tokenizer.save_pretrained(str(tokenizer_dir))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return write_tiny_llama(model_dir, seed, vocab=VOCAB, tokenizer_dir=tokenizer_dir)


def closing_bias(model_dir: Path, prompt_ids: list[int], end_id: int, steps: int = 24) -> tuple[float, list[int]]:
    """A logit bias on ``end_id`` (``</think>``) that makes the greedy model write it at a step k >= 2 and at no
    step before, and the greedy ids before it: from transformers' float32 logits of the unbiased greedy run (the
    bias changes no other token's rank, so the thinking is the model's own)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids, margins = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            margins.append(float(logits.max() - logits[end_id]))
            ids.append(int(logits.argmax()))
    # the first step k >= 2 where </think> is nearer the top than at every step before: a bias between the two
    # margins makes it the greedy choice there and nowhere before
    for k in range(2, len(margins)):
        if margins[k] < min(margins[:k]) - 0.2:
            return (margins[k] + min(margins[:k])) / 2, ids[len(prompt_ids):len(prompt_ids) + k]
    raise AssertionError(f"the random model never comes near {end_id}: margins {margins}")
