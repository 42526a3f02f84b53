"""Qwen3: the Llama layout with a per-head RMSNorm of q and k before RoPE, and no QKV bias by default."""

from __future__ import annotations

from typing import Any

from pagoda.modeling.layers.rotary import rope_from_hf
from pagoda.modeling.models.decoder import DecoderForCausalLM, DecoderSpec, activation, base_spec
from pagoda.modeling.models.llama import llama_windows


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_hf(cls, cfg: dict[str, Any]) -> DecoderSpec:
        base = base_spec(cfg)
        bias = bool(cfg.get("attention_bias", False))
        return DecoderSpec(**base, qkv_bias=bias, o_bias=bias, act=activation(cfg, "hidden_act"), qk_norm="head",
                           sliding_windows=llama_windows(cfg, base["num_layers"]),
                           ropes=(rope_from_hf(cfg),) * base["num_layers"])
