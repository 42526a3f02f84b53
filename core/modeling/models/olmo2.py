"""OLMo 2: norms after attention and MLP instead of before (the "post" layout), and an RMSNorm of the whole q
and k projections before RoPE."""

from __future__ import annotations

from typing import Any

from pagoda.modeling.layers.rotary import rope_from_hf
from pagoda.modeling.models.decoder import DecoderForCausalLM, DecoderSpec, activation, base_spec


class Olmo2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_hf(cls, cfg: dict[str, Any]) -> DecoderSpec:
        base = base_spec(cfg)
        bias = bool(cfg.get("attention_bias", False))
        return DecoderSpec(**base, qkv_bias=bias, o_bias=bias, act=activation(cfg, "hidden_act"), layout="post",
                           qk_norm="full", ropes=(rope_from_hf(cfg),) * base["num_layers"])
