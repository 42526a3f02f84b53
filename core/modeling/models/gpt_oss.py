"""gpt-oss: attention with per-head sinks on layers alternating a sliding window and full attention, YaRN RoPE,
biases everywhere, and routed experts with a biased router (softmax over the top-k logits) and a clamped
SwiGLU (``(clamp(up) + 1) * gate * sigmoid(alpha * gate)``, gate and up clamped at ``swiglu_limit``)."""

from __future__ import annotations

from typing import Any

from pagoda.modeling.layers.moe import RouterSpec
from pagoda.modeling.layers.rotary import rope_from_hf
from pagoda.modeling.models.decoder import DecoderSpec, base_spec, hf_field, layer_windows
from pagoda.modeling.models.moe_decoder import MoeDecoderForCausalLM, MoeSpec


class GptOssForCausalLM(MoeDecoderForCausalLM):
    """gpt-oss causal LM (bf16 or fp32 checkpoints; experts stacked as ``mlp.experts.gate_up_proj``)."""

    @classmethod
    def spec_from_hf(cls, cfg: dict[str, Any]) -> DecoderSpec:
        base = base_spec(cfg)
        n = base["num_layers"]
        bias = bool(cfg.get("attention_bias", True))
        moe = MoeSpec(num_experts=int(hf_field(cfg, "num_local_experts", required=True)),
                      intermediate_size=base["intermediate_size"],
                      router=RouterSpec(int(hf_field(cfg, "num_experts_per_tok", required=True)),
                                        softmax_over_top_k=True),
                      sparse_layers=(True,) * n, router_bias=True, activation="clamped_swiglu", expert_bias=True,
                      alpha=float(cfg.get("swiglu_alpha", 1.702)), limit=float(cfg.get("swiglu_limit", 7.0)))
        return DecoderSpec(**base, qkv_bias=bias, o_bias=bias, sinks=True,
                           sliding_windows=layer_windows(cfg, n, default_all=False),
                           ropes=(rope_from_hf(cfg),) * n, extra={"moe": moe})
