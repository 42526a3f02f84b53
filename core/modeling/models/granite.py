"""Granite: Llama with four multipliers (embeddings, attention scale, residual branches, logits divisor)."""

from __future__ import annotations

from typing import Any

from pagoda.modeling.layers.rotary import rope_from_hf
from pagoda.modeling.models.decoder import DecoderForCausalLM, DecoderSpec, activation, base_spec


class GraniteForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_hf(cls, cfg: dict[str, Any]) -> DecoderSpec:
        base = base_spec(cfg)
        bias = bool(cfg.get("attention_bias", False))
        return DecoderSpec(**base, qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
                           act=activation(cfg, "hidden_act"), ropes=(rope_from_hf(cfg),) * base["num_layers"],
                           embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
                           scale=float(cfg.get("attention_multiplier") or base["head_dim"] ** -0.5),
                           residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                           logits_divisor=float(cfg.get("logits_scaling", 1.0)))
