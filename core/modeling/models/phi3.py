"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``): the Llama layout whose checkpoint stores the fused ``qkv_proj`` and
``gate_up_proj`` themselves (the loader splits them by output sizes, so tensor parallelism, quantization configs
and LoRA see the usual q/k/v and gate/up slices), LongRoPE with short and long factors, a partial rotary factor
(Phi-4-mini rotates 3/4 of each head) and ``sliding_window`` over every layer where the config sets one."""

from __future__ import annotations

from typing import Any

from pagoda.modeling.layers.rotary import rope_from_hf
from pagoda.modeling.models.decoder import DecoderForCausalLM, DecoderSpec, activation, base_spec, layer_windows

# early Phi-3 configs name LongRoPE "su" (and some "yarn"); transformers reads both as longrope
_LONGROPE_ALIASES = ("su", "yarn")


def _phi3_rope_config(cfg: dict[str, Any]) -> dict[str, Any]:
    for key in ("rope_scaling", "rope_parameters"):
        scaling = cfg.get(key)
        if isinstance(scaling, dict) and (scaling.get("rope_type") or scaling.get("type")) in _LONGROPE_ALIASES:
            fixed = {k: v for k, v in scaling.items() if k != "type"}
            cfg = {**cfg, key: {**fixed, "rope_type": "longrope"}}
    return cfg


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 (mini, medium) and Phi-4-mini."""

    @classmethod
    def spec_from_hf(cls, cfg: dict[str, Any]) -> DecoderSpec:
        base = base_spec(cfg)
        n = base["num_layers"]
        return DecoderSpec(**base, act=activation(cfg, "hidden_act"),
                           sliding_windows=layer_windows(cfg, n, default_all=True),
                           ropes=(rope_from_hf(_phi3_rope_config(cfg)),) * n)
