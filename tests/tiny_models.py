"""Tiny Llama checkpoint directories: a one-layer config for tests that need engine options, not real weights,
and a two-layer one with random weights in real safetensors files."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from pagoda.modeling.default_model import ensure_default_model

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
}


@functools.cache
def default_vocab_size() -> int:
    """The number of tokens of the default model's tokenizer, added ones included: the vocabulary of the random
    checkpoints tests write with that tokenizer. Loaded once per process (a load takes some 0.2 s of CPU)."""
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(ensure_default_model())))


def write_tiny_checkpoint(directory: Path, chat_template: bool = True) -> Path:
    """config.json plus the default model's tokenizer (optionally without its chat template);
    load it with ``load_format="dummy"`` for random weights."""
    default_dir = ensure_default_model()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    shutil.copy(default_dir / "tokenizer.json", directory / "tokenizer.json")
    tok_config = json.loads((default_dir / "tokenizer_config.json").read_text())
    if chat_template:  # the default model keeps its template in a file of its own
        shutil.copy(default_dir / "chat_template.jinja", directory / "chat_template.jinja")
    else:
        tok_config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return directory


def tiny_llm(model_dir, **kwargs):
    """An engine on a ``write_tiny_checkpoint`` directory with random weights and a small KV cache."""
    from pagoda import LLM

    options = dict(load_format="dummy", kv_cache_memory_bytes=2 << 20, cpu_threads=1)
    return LLM(model=str(model_dir), **{**options, **kwargs})


def write_tiny_llama(model_dir, seed: int = 0, *, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                     head_dim: int = 64, inter: int = 128, vocab: int = 49152, layers: int = 2,
                     norm_noise: float = 0.0, tokenizer_dir: Optional[Path] = None,
                     chat_template: bool = False) -> Path:
    """A small Llama with random weights, as real safetensors files, in the existing directory ``model_dir``: by
    default 2 layers, hidden 64, 4 heads / 2 KV heads of 64, and the default model's tokenizer (or
    ``tokenizer_dir``'s, whose vocabulary ``vocab`` must then cover); with ``chat_template``, its chat template
    too (a served model that answers /v1/chat/completions).

    The LM head is not tied: with tied random embeddings every token would predict itself and attention
    would not show in the tokens. The norms' weights are 1, or ``1 + norm_noise * randn`` (a test where the norms
    must matter)."""
    model_dir = Path(model_dir)
    source = Path(tokenizer_dir) if tokenizer_dir is not None else ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json") + (("chat_template.jinja",) if chat_template else ()):
        shutil.copy(source / name, model_dir / name)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        # scaled so activations keep unit size and the greedy choice is not a near-tie
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    def norm() -> torch.Tensor:
        return 1 + norm_noise * torch.randn(hidden, generator=gen) if norm_noise else torch.ones(hidden)

    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen),
               "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
        })
    tensors["model.norm.weight"] = norm()
    save_file(tensors, str(model_dir / "model.safetensors"))
    return model_dir
