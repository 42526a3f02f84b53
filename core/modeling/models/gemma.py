"""Gemma 2 and Gemma 3 (text): sandwich norms applied as (1 + w), embeddings times sqrt(hidden), GELU (tanh)
MLP, sliding-window layers alternating with global ones, attention and final-logit soft-capping (Gemma 2), q/k
norms and a RoPE of its own for the local layers (Gemma 3)."""

from __future__ import annotations

from typing import Any

from pagoda.modeling.layers.rotary import RopeSpec, rope_from_hf
from pagoda.modeling.models.decoder import DecoderForCausalLM, DecoderSpec, activation, base_spec, layer_windows


def _gemma_spec(cfg: dict[str, Any], sliding_every: int, **more: Any) -> DecoderSpec:
    base = base_spec(cfg)
    base["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
    n = base["num_layers"]
    windows = layer_windows(cfg, n, default_all=False)
    if not windows and cfg.get("sliding_window"):
        # configs without layer_types: every layer but each sliding_every-th slides
        windows = tuple(None if (i + 1) % sliding_every == 0 else int(cfg["sliding_window"]) for i in range(n))
    return DecoderSpec(**base, layout="sandwich", norm_offset=1.0,
                       act=activation(cfg, "hidden_activation", "hidden_act"),
                       scale=float(cfg.get("query_pre_attn_scalar") or base["head_dim"]) ** -0.5,
                       sliding_windows=windows, embed_scale=base["hidden_size"] ** 0.5, **more)


class Gemma2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_hf(cls, cfg: dict[str, Any]) -> DecoderSpec:
        rope = rope_from_hf(cfg)
        n = int(cfg["num_hidden_layers"])
        return _gemma_spec(cfg, 2, attn_softcap=cfg.get("attn_logit_softcapping"),
                           final_softcap=cfg.get("final_logit_softcapping"), ropes=(rope,) * n)


class Gemma3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_hf(cls, cfg: dict[str, Any]) -> DecoderSpec:
        n = int(cfg["num_hidden_layers"])
        params = cfg.get("rope_parameters") or {}
        if isinstance(params.get("sliding_attention"), dict):  # transformers 5: one RoPE per layer type
            local, global_ = rope_from_hf(cfg, "sliding_attention"), rope_from_hf(cfg, "full_attention")
        else:
            global_ = rope_from_hf(cfg, default_theta=1_000_000.0)
            local = RopeSpec.of(float(cfg.get("rope_local_base_freq") or 10000.0), None, 1.0,
                                int(cfg.get("max_position_embeddings") or 2048))
        spec = _gemma_spec(cfg, int(cfg.get("sliding_window_pattern") or 6), qk_norm="head",
                           attn_softcap=cfg.get("attn_logit_softcapping"),
                           final_softcap=cfg.get("final_logit_softcapping"), ropes=())
        ropes = tuple(local if spec.window(i) else global_ for i in range(n))
        from dataclasses import replace
        return replace(spec, ropes=ropes)
