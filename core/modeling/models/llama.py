"""Llama-family decoder (Llama, Mistral, Qwen2) over flattened, unpadded token batches."""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from pagoda.config import ModelConfig
from pagoda.errors import CheckpointError, ConfigError
from pagoda.execution import distributed
from pagoda.modeling.layers import onednn
from pagoda.modeling.layers.attention import Attention, kv_scale_target
from pagoda.modeling.layers.fused_ops import CpuKernels
from pagoda.modeling.layers.linear import Linear
from pagoda.modeling.layers.norm import RMSNorm
from pagoda.modeling.layers.rotary import RotaryEmbedding, StepRotary

# checkpoint name fragment -> (fused module fragment, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, text_cfg: dict[str, Any], backend: Any, quant: Any, idx: int,
                 kernels: CpuKernels) -> None:
        super().__init__()
        self.kernels = kernels
        dtype, d = cfg.dtype, cfg.head_dim
        h, hkv = cfg.num_heads, cfg.num_kv_heads
        is_qwen2 = text_cfg.get("model_type") == "qwen2"
        # Llama's attention_bias covers q, k, v and o; Qwen2 always biases q, k, v and never o
        qkv_bias = True if is_qwen2 else bool(text_cfg.get("attention_bias", False))
        o_bias = False if is_qwen2 else bool(text_cfg.get("attention_bias", False))
        mlp_bias = bool(text_cfg.get("mlp_bias", False))
        inter = int(text_cfg["intermediate_size"])
        eps = float(text_cfg.get("rms_norm_eps", 1e-6))
        prefix = f"model.layers.{idx}"
        q = lambda name: quant.for_layer(f"{prefix}.{name}") if quant is not None else None  # noqa: E731
        # tensor parallelism: this rank's heads and MLP columns (all of them in a process of its own)
        tp = distributed.current()
        heads = distributed.head_shard(h, hkv, tp)
        sharded = tp.size > 1
        qkv_rows = [(heads.q_start * d, heads.num_heads * d)] + [(heads.kv_start * d, heads.num_kv_heads * d)] * 2
        mlp_part = distributed.split(inter, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, d
        self.qkv_proj = Linear(cfg.hidden_size, [h * d, hkv * d, hkv * d], qkv_bias, dtype, q("self_attn.qkv_proj"),
                               f"{prefix}.self_attn.qkv_proj", tp_rows=qkv_rows if sharded else None,
                               kernels=kernels)
        self.o_proj = Linear(h * d, [cfg.hidden_size], o_bias, dtype, q("self_attn.o_proj"), f"{prefix}.self_attn.o_proj",
                             tp_cols=qkv_rows[0] if sharded else None, kernels=kernels)
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], mlp_bias, dtype, q("mlp.gate_up_proj"),
                                   f"{prefix}.mlp.gate_up_proj", tp_rows=[mlp_part] * 2 if sharded else None,
                                   kernels=kernels)
        self.down_proj = Linear(inter, [cfg.hidden_size], mlp_bias, dtype, q("mlp.down_proj"), f"{prefix}.mlp.down_proj",
                                tp_cols=mlp_part if sharded else None, kernels=kernels)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, kernels)
        self.attn = Attention(backend, idx, heads.num_heads, heads.num_kv_heads, d, d ** -0.5)

    def forward(self, x, residual, rope: StepRotary, kv_cache, metadata):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        qkv = self.qkv_proj(x)  # [num_tokens, (h + 2 hkv) * d]
        q, k, v = rope.split_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        attn_out = self.attn(q, k, v, kv_cache, metadata)  # [num_tokens, h * d]
        x = self.o_proj(attn_out)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))
        return x, residual


class MissingLayer(nn.Module):
    """The place of a decoder layer another pipeline stage holds: no weights, never run."""

    def forward(self, *args: Any) -> None:
        raise RuntimeError("a decoder layer of another pipeline stage was run on this one")


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 causal LM. ``forward`` takes one step's flattened tokens."""

    # given the caches of its first N layers only, forward runs those N layers, then the final norm:
    # a self-speculation draft ("self:layers=N") is the target itself
    runs_first_layers_of_caches = True
    # builds this rank's shard under tensor parallelism (pagoda.execution.distributed.current())
    supports_tensor_parallel = True
    # builds only its pipeline stage's layers (pagoda.execution.distributed.current_stage()); forward takes
    # ``intermediate`` and returns (hidden states, residual) before the last stage
    supports_pipeline_parallel = True
    # fused layer -> the checkpoint projections it stacks, in output order (a LoRA adapter's q_proj is slice 0)
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, cfg: ModelConfig, backend: Any, quant: Any = None) -> None:
        super().__init__()
        text_cfg = cfg.hf_config.get("text_config", cfg.hf_config)
        window = text_cfg.get("sliding_window")
        uses_window = window and text_cfg.get("use_sliding_window", text_cfg.get("model_type") != "qwen2")
        if uses_window and cfg.max_model_len > int(window):
            raise ConfigError(
                f"this model attends over a sliding window of {window} tokens, which pagoda does not implement; "
                f"pass --max-model-len {window} (or less) so the window never slides"
            )
        self.cfg = cfg
        # the CPU kernels of this model's layers, chosen from its engine's host settings
        self.kernels = kernels = CpuKernels(cfg.host)
        # vocab parallelism: this rank's rows of the embedding and the LM head (all of them alone)
        self.tp = tp = distributed.current()
        # pipeline parallelism: this stage's layers; the embedding on the first, the norm and LM head on the last
        self.stage = stage = distributed.current_stage()
        self.vocab_parts = [distributed.split(cfg.vocab_size, tp.size, r)[1] for r in range(tp.size)]
        self.vocab_start, vocab_rows = distributed.split(cfg.vocab_size, tp.size, tp.rank)
        self.tie_word_embeddings = bool(text_cfg.get("tie_word_embeddings", False))
        self.embed_tokens = None
        if stage.is_first or (stage.is_last and self.tie_word_embeddings):
            self.embed_tokens = nn.Embedding(vocab_rows, cfg.hidden_size, dtype=cfg.dtype)
            self.embed_tokens.weight.requires_grad_(False)
            if tp.size > 1:
                self.embed_tokens.weight.weight_loader = self._load_vocab_rows
        self.layers = nn.ModuleList(DecoderLayer(cfg, text_cfg, backend, quant, i, kernels) if stage.owns_layer(i)
                                    else MissingLayer() for i in range(cfg.num_layers))
        # the layers forward runs, and whether it ends the model (a tuple: not registered as submodules again)
        self._stage_layers = tuple(self.layers[stage.layer_start:stage.layer_end])
        self._is_last_stage = stage.is_last
        self.norm = self.lm_head = None
        if stage.is_last:
            self.norm = RMSNorm(cfg.hidden_size, float(text_cfg.get("rms_norm_eps", 1e-6)), cfg.dtype, kernels)
            if not self.tie_word_embeddings:
                self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size], False, cfg.dtype, None, "lm_head",
                                      tp_rows=[(self.vocab_start, vocab_rows)] if tp.size > 1 else None,
                                      kernels=kernels)
        rope = text_cfg.get("rope_parameters") or {}
        theta = float(text_cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        scaling = text_cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        self.rotary = RotaryEmbedding(cfg.head_dim, max(cfg.max_model_len, int(text_cfg.get(
            "max_position_embeddings", cfg.max_model_len))), theta, scaling, cfg.dtype, kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, metadata: Any,
                intermediate: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> Any:
        """``input_ids``, ``positions``: ``[num_tokens]``. Returns hidden states ``[num_tokens, hidden]``.

        Runs one decoder layer per entry of ``kv_caches`` (all of them normally; the first N for a
        self-speculation draft). On a pipeline stage, ``kv_caches`` are the stage's layers'; a stage after the
        first starts from ``intermediate`` (the previous stage's hidden states and residual), and a stage
        before the last returns its own ``(hidden states, residual)`` instead of the normed hidden states."""
        if intermediate is None:
            x = self.embed_tokens(input_ids) if self.tp.size == 1 else self._embed_parallel(input_ids)
            residual = None
        else:
            x, residual = intermediate
        rope = self.rotary.at(positions)  # once per step, not per layer
        for layer, kv_cache in zip(self._stage_layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, metadata)
        if not self._is_last_stage:
            return x, residual
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden] -> [n, vocab]`` in float32."""
        if self.lm_head is None:
            head = self._tied_head()
            if head is not None:
                logits = onednn.packed_linear(hidden, head).float()
            else:
                logits = self.kernels.linear(hidden, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        return logits if self.tp.size == 1 else self.tp.all_gather_last(logits, self.vocab_parts)

    def _embed_parallel(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each rank looks up the ids in its rows (zeros for the others); the sum over ranks is the embedding."""
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(torch.where(mine, local, 0)) * mine[:, None].to(self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(x, "embedding")

    def _load_vocab_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard: Optional[int], name: str) -> None:
        rows = loaded.narrow(0, self.vocab_start, param.shape[0])
        if tuple(rows.shape) != tuple(param.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(loaded.shape)}; the model expects "
                                  f"{self.cfg.vocab_size} rows of {param.shape[1]}")
        param.data.copy_(rows.to(param.dtype))

    def _tied_head(self) -> Optional[torch.Tensor]:
        """The embedding packed for the LM head (see ``layers.onednn``), made on first use and again
        whenever the embedding changes; None where packing does not apply. The embedding itself stays
        plain for the token lookup."""
        w = self.embed_tokens.weight
        key = (w.data_ptr(), w.dtype, None if w.is_inference() else w._version)
        if getattr(self, "_packed_head_key", None) != key:
            self._packed_head = self.kernels.pack_weight(w.data)
            self._packed_head_key = key
        return self._packed_head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill parameters from ``(checkpoint_name, tensor)`` pairs; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or self._on_another_stage(name):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied to the embedding
            if (kv_scale := kv_scale_target(name)) is not None:
                self._load_kv_scale(name, tensor, *kv_scale)
                continue
            target, shard = _map_name(name)
            param = params.get(target)
            if param is None:
                raise CheckpointError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}; "
                    "the checkpoint does not match its config.json"
                )
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, shard, name)
            else:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise CheckpointError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)} but the model expects {tuple(param.shape)}"
                    )
                param.data.copy_(tensor.to(param.dtype))
            loaded.add(target if shard is None else f"{target}#{shard}")
        expected = set()
        for pname, param in params.items():
            if getattr(param, "is_optional", False):
                continue  # a quant method's optional tensor (GPTQ g_idx without act-order)
            module = self.get_submodule(pname.rsplit(".", 1)[0]) if "." in pname else self
            shards = len(module.output_sizes) if isinstance(module, Linear) and len(module.output_sizes) > 1 else 0
            expected.update({f"{pname}#{i}" for i in range(shards)} if shards else {pname})
        missing = sorted(expected - loaded)
        if missing:
            raise CheckpointError(
                f"checkpoint is missing {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}"
            )
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()
        if self.lm_head is None and self.stage.is_last:
            self._tied_head()  # packed now, not in the first request's step

    def _on_another_stage(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to a part of the model another pipeline stage holds."""
        if self.stage.num_stages == 1:
            return False
        if name.startswith("model.layers."):
            index = name.split(".")[2]
            return index.isdigit() and not self.stage.owns_layer(int(index))
        if name == "model.embed_tokens.weight":
            return self.embed_tokens is None
        return name.startswith(("model.norm.", "lm_head.")) and not self.stage.is_last

    def _load_kv_scale(self, name: str, tensor: torch.Tensor, layer_idx: int, which: str) -> None:
        """A per-layer fp8 KV cache scale (used only with kv_cache_dtype fp8)."""
        if layer_idx >= len(self.layers):
            raise CheckpointError(f"checkpoint tensor {name!r} names layer {layer_idx}, but the model has "
                                  f"{len(self.layers)} layers; the checkpoint does not match its config.json")
        self.layers[layer_idx].attn.load_kv_scale(which, tensor, name)


def _map_name(name: str) -> tuple[str, Optional[int]]:
    """Checkpoint name -> (parameter name, shard index in a fused layer or None)."""
    if name.startswith("model."):
        name = name[len("model."):]
    for frag, (fused, shard) in _STACKED.items():
        if frag in name:
            return name.replace(frag, fused).replace(".self_attn.qkv_proj.", ".qkv_proj.").replace(
                ".mlp.gate_up_proj.", ".gate_up_proj."), shard
    name = name.replace(".self_attn.o_proj.", ".o_proj.").replace(".mlp.down_proj.", ".down_proj.")
    return name, None
