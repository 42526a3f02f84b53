"""A one-layer Llama checkpoint directory for tests that need engine options, not real weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pagoda.default_model import ensure_default_model

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
}


def write_tiny_checkpoint(directory: Path, chat_template: bool = True) -> Path:
    """config.json plus the default model's tokenizer (optionally without its chat template);
    load it with ``load_format="dummy"`` for random weights."""
    default_dir = ensure_default_model()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    shutil.copy(default_dir / "tokenizer.json", directory / "tokenizer.json")
    tok_config = json.loads((default_dir / "tokenizer_config.json").read_text())
    if not chat_template:
        tok_config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return directory
