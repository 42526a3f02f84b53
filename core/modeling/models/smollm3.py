"""SmolLM3: Llama whose ``no_rope_layers`` turns RoPE off in some layers (an entry of 0: no RoPE)."""

from __future__ import annotations

from typing import Any

from pagoda.errors import ConfigError
from pagoda.modeling.layers.rotary import rope_from_hf
from pagoda.modeling.models.decoder import DecoderForCausalLM, DecoderSpec, activation, base_spec
from pagoda.modeling.models.llama import llama_windows


class SmolLM3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_hf(cls, cfg: dict[str, Any]) -> DecoderSpec:
        base = base_spec(cfg)
        n = base["num_layers"]
        uses_rope = cfg.get("no_rope_layers") or [1] * n
        if len(uses_rope) != n:
            raise ConfigError(f"config.json no_rope_layers has {len(uses_rope)} entries for {n} layers")
        rope = rope_from_hf(cfg)
        bias = bool(cfg.get("attention_bias", False))
        return DecoderSpec(**base, qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
                           act=activation(cfg, "hidden_act"), sliding_windows=llama_windows(cfg, n),
                           ropes=tuple(rope if use else None for use in uses_rope))
