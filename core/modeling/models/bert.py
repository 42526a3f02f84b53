"""BERT-family encoders (BERT, RoBERTa, XLM-R and the BGE/E5/GTE checkpoints built on them) for pooling.

Bidirectional attention over each whole sequence, no KV cache. A batch is packed, not padded: its sequences'
tokens lie end to end (``[tokens, hidden]``), so the linear layers do no work on padding, and attention runs
once per run of consecutive sequences of one length (no mask). The same module serves embeddings (the last
hidden states, pooled outside) and cross-encoder scores (``*ForSequenceClassification``: the classifier head on
the first token). In float32 on an x86 CPU, and in bf16 on one with AVX-512, the linear layers' weights are
reordered once, at load, into oneDNN's blocked layout (:class:`PackedLinear`; in float32 10-30% faster than the
same matrix products through MKL), query, key and value as one product.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.errors import CheckpointError, ConfigError
from pagoda.host.env import HostConfig
from pagoda.modeling.layers import onednn
from pagoda.modeling.loader import iter_checkpoint

# config.json's architectures -> (model_type family, has a classification head)
ENCODER_ARCHITECTURES = {
    "BertModel": ("bert", False), "BertForSequenceClassification": ("bert", True),
    "RobertaModel": ("roberta", False), "RobertaForSequenceClassification": ("roberta", True),
    "XLMRobertaModel": ("roberta", False), "XLMRobertaForSequenceClassification": ("roberta", True),
}
_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def _required(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise ConfigError(f"config.json has no {key!r}, which a BERT-family encoder needs")
    return cfg[key]


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int, num_heads: int, intermediate: int, eps: float, act: str) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.qkv: Optional[nn.Module] = None  # query, key and value as one packed product, once packed
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.up = nn.Linear(hidden, intermediate)
        self.down = nn.Linear(intermediate, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=eps)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, runs: list[tuple[int, int, int]]) -> torch.Tensor:
        # x: [tokens, hidden], the batch's sequences end to end; runs: (first token, sequences, length) of each
        # run of consecutive sequences of one length
        h = x.shape[-1]
        if self.qkv is not None:
            q, k, v = self.qkv(x).split(h, dim=-1)
        else:
            q, k, v = self.query(x), self.key(x), self.value(x)
        parts = []
        for start, count, length in runs:
            end = start + count * length
            heads = lambda t: t[start:end].view(count, length, self.num_heads, h // self.num_heads  # noqa: E731
                                                ).transpose(1, 2)
            attn = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))  # [count, heads, length, d]
            parts.append(attn.transpose(1, 2).reshape(count * length, h))
        attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        x = self.attn_norm(x + self.attn_out(attn))
        return self.out_norm(x + self.down(self.act(self.up(x))))


class PackedLinear(nn.Module):
    """A float32 or bf16 linear layer whose weight oneDNN reordered once into its blocked layout (the original
    weight is dropped): the same products as :func:`torch.nn.functional.linear` to float32 rounding (bf16: the same
    bits), faster on x86 CPUs."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1024)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack_linears(dtype: torch.dtype, host: Optional[HostConfig] = None) -> bool:
    """Whether :class:`PackedLinear` applies: float32 on an x86 CPU whose torch has oneDNN, or bf16 where the
    engine packs bf16 weights (AVX-512 and oneDNN's packed product reproducing ``F.linear``)."""
    import platform

    if dtype == torch.bfloat16:
        return host is not None and onednn.packing_available(host)
    return (dtype == torch.float32 and platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class EncoderModel(nn.Module):
    """A BERT-family encoder; ``num_labels`` > 0 adds the sequence-classification head of its family."""

    def __init__(self, cfg: dict[str, Any], family: str, num_labels: int, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = int(_required(cfg, "hidden_size"))
        num_heads = int(_required(cfg, "num_attention_heads"))
        if hidden % num_heads:
            raise ConfigError(f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads "
                              f"{num_heads}")
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ConfigError(f"config.json: hidden_act {act!r} is not implemented for encoders; pagoda has "
                              f"{sorted(_ACTIVATIONS)}")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError(f"config.json: position_embedding_type {cfg['position_embedding_type']!r} is not "
                              "implemented; pagoda's encoders have absolute position embeddings")
        eps = float(cfg.get("layer_norm_eps", 1e-12))
        self.family = family
        # RoBERTa numbers positions from padding_idx + 1 (its position 0..padding_idx rows are never used)
        self.position_offset = int(cfg.get("pad_token_id", 1)) + 1 if family == "roberta" else 0
        self.max_positions = int(_required(cfg, "max_position_embeddings")) - self.position_offset
        self.word_embeddings = nn.Embedding(int(_required(cfg, "vocab_size")), hidden)
        self.position_embeddings = nn.Embedding(int(cfg["max_position_embeddings"]), hidden)
        self.token_type_embeddings = nn.Embedding(int(cfg.get("type_vocab_size", 2)), hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(
            EncoderLayer(hidden, num_heads, int(_required(cfg, "intermediate_size")), eps, act)
            for _ in range(int(_required(cfg, "num_hidden_layers"))))
        self.num_labels = num_labels
        self.hidden_size = hidden
        if num_labels:
            # BERT: tanh pooler on the first token, then the classifier; RoBERTa: dense + tanh + out_proj
            self.head_dense = nn.Linear(hidden, hidden)
            self.head_out = nn.Linear(hidden, num_labels)
        self.to(dtype)

    @classmethod
    def from_checkpoint(cls, model_dir: str, cfg: dict[str, Any], dtype: torch.dtype,
                        host: Optional[HostConfig] = None) -> "EncoderModel":
        arch = (cfg.get("architectures") or [""])[0]
        family, classifies = ENCODER_ARCHITECTURES[arch]
        num_labels = 0
        if classifies:
            num_labels = int(cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2))
        model = cls(cfg, family, num_labels, dtype)
        model.load_weights(iter_checkpoint(Path(model_dir)))
        if can_pack_linears(dtype, host):
            model.pack_linears()
        return model.eval()

    def pack_linears(self) -> None:
        """Swap every linear layer for a :class:`PackedLinear` (once the weights are loaded); each layer's query,
        key and value become one product."""
        for layer in self.layers:
            parts = (layer.query, layer.key, layer.value)
            fused = nn.Linear(layer.query.in_features, 3 * layer.query.out_features, dtype=layer.query.weight.dtype)
            with torch.no_grad():
                fused.weight.copy_(torch.cat([p.weight for p in parts]))
                fused.bias.copy_(torch.cat([p.bias for p in parts]))
            layer.qkv = PackedLinear(fused)
            del layer.query, layer.key, layer.value
        for module in [self, *self.layers]:
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, PackedLinear(child))

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """``input_ids``, ``token_type_ids``: ``[tokens]``, the batch's sequences end to end; ``lengths``: each
        sequence's length, in that order. Returns the last hidden states ``[tokens, hidden]``, packed alike."""
        positions = torch.cat([torch.arange(n) for n in lengths]) + self.position_offset
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids) + \
            self.position_embeddings(positions)
        x = self.embed_norm(x)
        runs: list[tuple[int, int, int]] = []  # (first token, sequences, length)
        start = 0
        for n in lengths:
            if runs and runs[-1][2] == n:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1, n)
            else:
                runs.append((start, 1, n))
            start += n
        for layer in self.layers:
            x = layer(x, runs)
        return x

    def classify(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """The first token's hidden state of each sequence ``[batch, hidden]`` -> the classification head's
        logits ``[batch, num_labels]``."""
        return self.head_out(torch.tanh(self.head_dense(first_tokens)))

    # ---- loading -------------------------------------------------------------------------------------

    def _map_name(self, name: str) -> Optional[str]:
        for prefix in ("bert.", "roberta.", "model."):
            name = name.removeprefix(prefix)
        if name.startswith("embeddings."):
            rest = name.removeprefix("embeddings.")
            if rest.startswith("LayerNorm."):
                return "embed_norm." + rest.removeprefix("LayerNorm.")
            if rest == "position_ids" or rest == "token_type_ids":
                return None  # buffers transformers saves; positions are computed here
            return rest
        if name.startswith("encoder.layer."):
            idx, rest = name.removeprefix("encoder.layer.").split(".", 1)
            for theirs, ours in (("attention.self.query.", "query."), ("attention.self.key.", "key."),
                                 ("attention.self.value.", "value."), ("attention.output.dense.", "attn_out."),
                                 ("attention.output.LayerNorm.", "attn_norm."), ("intermediate.dense.", "up."),
                                 ("output.dense.", "down."), ("output.LayerNorm.", "out_norm.")):
                if rest.startswith(theirs):
                    return f"layers.{idx}.{ours}{rest.removeprefix(theirs)}"
        heads = {"pooler.dense.": "head_dense.", "classifier.dense.": "head_dense.",
                 "classifier.out_proj.": "head_out."}
        if self.family == "bert":
            heads["classifier."] = "head_out."
        for theirs, ours in heads.items():
            if name.startswith(theirs):
                return ours + name.removeprefix(theirs) if self.num_labels else None
        if name.startswith(("pooler.", "lm_head.", "cls.")):
            return None  # heads an embedding model does not use
        raise CheckpointError(f"the checkpoint's tensor {name!r} is not part of a {self.family} encoder")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            ours = self._map_name(name)
            if ours is None:
                continue
            param = params.get(ours)
            if param is None or param.shape != tensor.shape:
                raise CheckpointError(f"the checkpoint's tensor {name!r} {tuple(tensor.shape)} does not fit the "
                                      f"model's {ours!r} {None if param is None else tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            loaded.add(ours)
        missing = sorted(set(params) - loaded)
        if missing:
            raise CheckpointError(f"the checkpoint has no tensors for {missing[:5]} ({len(missing)} in all)")

