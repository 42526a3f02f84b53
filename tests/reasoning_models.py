"""A tiny random Llama that can think: the default model's tokenizer with ``<think>`` and ``</think>`` added as
special tokens (single ids, as in Qwen3's and DeepSeek-R1's vocabularies) and a Qwen3-style chat template whose
generation prompt opens the thinking, or closes an empty thinking block with ``enable_thinking`` false."""

from __future__ import annotations

import json
from pathlib import Path

from pagoda.modeling.default_model import ensure_default_model
from tiny_models import write_tiny_llama

THINKING_TEMPLATE = (
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
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer.save_pretrained(str(tokenizer_dir))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return write_tiny_llama(model_dir, seed, vocab=VOCAB, tokenizer_dir=tokenizer_dir)
