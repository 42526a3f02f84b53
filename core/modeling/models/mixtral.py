"""Mixtral: the Mistral decoder with eight (or more) routed experts per layer, softmax router, top-k renormalized."""

from __future__ import annotations

from typing import Any

from pagoda.modeling.layers.moe import RouterSpec
from pagoda.modeling.layers.rotary import rope_from_hf
from pagoda.modeling.models.decoder import DecoderSpec, activation, base_spec, hf_field, layer_windows
from pagoda.modeling.models.moe_decoder import MoeDecoderForCausalLM, MoeSpec


class MixtralForCausalLM(MoeDecoderForCausalLM):
    """Mixtral causal LM (checkpoint experts: ``block_sparse_moe.experts.E.w1/w2/w3``)."""

    @classmethod
    def spec_from_hf(cls, cfg: dict[str, Any]) -> DecoderSpec:
        base = base_spec(cfg)
        n = base["num_layers"]
        num_experts = int(hf_field(cfg, "num_local_experts", required=True))
        moe = MoeSpec(num_experts=num_experts, intermediate_size=base["intermediate_size"],
                      router=RouterSpec(int(hf_field(cfg, "num_experts_per_tok", 2))), sparse_layers=(True,) * n)
        return DecoderSpec(**base, act=activation(cfg, "hidden_act"),
                           sliding_windows=layer_windows(cfg, n, default_all=True),
                           ropes=(rope_from_hf(cfg, default_theta=1e6),) * n, extra={"moe": moe})
