"""The Llama family (Llama, Mistral, Qwen2): the decoder of :mod:`pagoda.modeling.models.decoder` as their
config.json describes it."""

from __future__ import annotations

from typing import Any

from pagoda.modeling.layers.rotary import rope_from_hf
from pagoda.modeling.models.decoder import DecoderForCausalLM, DecoderSpec, activation, base_spec, layer_windows


def llama_windows(cfg: dict[str, Any], num_layers: int):
    """Mistral slides ``sliding_window`` over every layer; Qwen2 only with ``use_sliding_window``, from layer
    ``max_window_layers`` on; a transformers 5 config lists ``layer_types`` itself."""
    if cfg.get("layer_types"):
        return layer_windows(cfg, num_layers, default_all=False)
    if cfg.get("model_type") in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
            return ()
        first = int(cfg.get("max_window_layers") or 0)
        return tuple(int(cfg["sliding_window"]) if i >= first else None for i in range(num_layers))
    return layer_windows(cfg, num_layers, default_all=cfg.get("use_sliding_window", True))


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama / Mistral / Qwen2 causal LM."""

    @classmethod
    def spec_from_hf(cls, cfg: dict[str, Any]) -> DecoderSpec:
        base = base_spec(cfg)
        is_qwen2 = cfg.get("model_type") == "qwen2"
        # Llama's attention_bias covers q, k, v and o; Qwen2 always biases q, k, v and never o
        bias = bool(cfg.get("attention_bias", False))
        rope = rope_from_hf(cfg)
        return DecoderSpec(**base, qkv_bias=True if is_qwen2 else bias, o_bias=False if is_qwen2 else bias,
                           mlp_bias=bool(cfg.get("mlp_bias", False)), act=activation(cfg, "hidden_act"),
                           sliding_windows=llama_windows(cfg, base["num_layers"]),
                           ropes=(rope,) * base["num_layers"])
