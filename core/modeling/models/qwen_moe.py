"""Qwen2-MoE (routed experts plus a gated shared expert) and Qwen3-MoE (routed experts, q/k norms)."""

from __future__ import annotations

from typing import Any

from pagoda.modeling.layers.moe import RouterSpec
from pagoda.modeling.layers.rotary import rope_from_hf
from pagoda.modeling.models.decoder import DecoderSpec, activation, base_spec, hf_field, layer_windows
from pagoda.modeling.models.moe_decoder import MoeDecoderForCausalLM, MoeSpec, moe_count, sparse_layers


def _windows(cfg: dict[str, Any], num_layers: int):
    """Qwen slides a window only with ``use_sliding_window`` (``layer_types`` says where, when listed)."""
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
        return ()
    if cfg.get("layer_types"):
        return layer_windows(cfg, num_layers, default_all=False)
    first = int(cfg.get("max_window_layers") or 0)
    return tuple(int(cfg["sliding_window"]) if i >= first else None for i in range(num_layers))


def _moe(cfg: dict[str, Any], num_layers: int, **shared: Any) -> MoeSpec:
    num_experts = moe_count(cfg, "num_experts", "num_local_experts")
    return MoeSpec(num_experts=num_experts, intermediate_size=int(hf_field(cfg, "moe_intermediate_size", required=True)),
                   router=RouterSpec(int(hf_field(cfg, "num_experts_per_tok", required=True)),
                                     renormalize=bool(cfg.get("norm_topk_prob", False))),
                   sparse_layers=sparse_layers(cfg, num_layers, num_experts), **shared)


class Qwen2MoeForCausalLM(MoeDecoderForCausalLM):
    """Qwen2-MoE causal LM: q/k/v biases, and beside the routed experts a shared expert scaled by
    ``sigmoid(shared_expert_gate(x))``."""

    @classmethod
    def spec_from_hf(cls, cfg: dict[str, Any]) -> DecoderSpec:
        base = base_spec(cfg)
        n = base["num_layers"]
        moe = _moe(cfg, n, shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                   shared_gate=True)
        return DecoderSpec(**base, qkv_bias=bool(cfg.get("qkv_bias", True)), act=activation(cfg, "hidden_act"),
                           sliding_windows=_windows(cfg, n), ropes=(rope_from_hf(cfg),) * n, extra={"moe": moe})


class Qwen3MoeForCausalLM(MoeDecoderForCausalLM):
    """Qwen3-MoE causal LM: RMSNorm of each q and k head before RoPE, routed experts only."""

    @classmethod
    def spec_from_hf(cls, cfg: dict[str, Any]) -> DecoderSpec:
        base = base_spec(cfg)
        n = base["num_layers"]
        bias = bool(cfg.get("attention_bias", False))
        return DecoderSpec(**base, qkv_bias=bias, o_bias=bias, qk_norm="head", act=activation(cfg, "hidden_act"),
                           sliding_windows=_windows(cfg, n), ropes=(rope_from_hf(cfg),) * n,
                           extra={"moe": _moe(cfg, n)})
