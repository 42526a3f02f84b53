"""How a pooling model turns hidden states into one vector: the sentence-transformers files of a checkpoint
(``modules.json``, ``1_Pooling/config.json``, ``sentence_bert_config.json``), the task a checkpoint serves,
and the pooling itself."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from pagoda.errors import ConfigError
from pagoda.modeling.models.bert import ENCODER_ARCHITECTURES

TASKS = ("generate", "embed", "score")
POOLING_METHODS = ("cls", "mean", "last")
# 1_Pooling/config.json's switches -> pagoda's method
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingConfig:
    """``method``: which hidden states make the vector; ``normalize``: L2-normalized (sentence-transformers'
    Normalize module); ``max_seq_length``: the longest input the checkpoint was built for (None: its
    positions); ``matryoshka``: the model's leading dimensions are an embedding of their own (a request's
    ``dimensions`` may cut it)."""

    method: str
    normalize: bool
    max_seq_length: Optional[int] = None
    matryoshka: bool = False


def _read_json(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})") from None


def is_encoder(hf_config: dict[str, Any]) -> bool:
    return (hf_config.get("architectures") or [""])[0] in ENCODER_ARCHITECTURES


def detect_task(model_dir: str, hf_config: dict[str, Any]) -> str:
    """The task a checkpoint serves when ``--task auto``: ``score`` for a sequence-classification encoder (a
    cross-encoder), ``embed`` for other encoders and for decoders shipped with sentence-transformers files,
    ``generate`` otherwise."""
    arch = (hf_config.get("architectures") or [""])[0]
    if arch in ENCODER_ARCHITECTURES:
        return "score" if ENCODER_ARCHITECTURES[arch][1] else "embed"
    if (Path(model_dir) / "modules.json").is_file():
        return "embed"
    return "generate"


def read_pooling_config(model_dir: str, hf_config: dict[str, Any]) -> PoolingConfig:
    """The pooling a checkpoint asks for. Without sentence-transformers files: the first token, normalized, for
    an encoder; the last token, normalized, for a decoder (vLLM's defaults)."""
    root = Path(model_dir)
    default = "cls" if is_encoder(hf_config) else "last"
    modules = _read_json(root / "modules.json")
    st_config = _read_json(root / "sentence_bert_config.json") or {}
    max_seq_length = st_config.get("max_seq_length")
    matryoshka = bool(hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions"))
    if modules is None:
        return PoolingConfig(default, True, max_seq_length, matryoshka)
    method, normalize = default, False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            method = _pooling_method(root / module.get("path", "1_Pooling") / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ConfigError(f"{root / 'modules.json'}: the sentence-transformers module {module.get('type')!r} "
                              "is not implemented; pagoda applies Transformer, Pooling and Normalize modules")
    return PoolingConfig(method, normalize, max_seq_length, matryoshka)


def _pooling_method(path: Path) -> str:
    cfg = _read_json(path)
    if cfg is None:
        raise ConfigError(f"modules.json names a Pooling module but {path} is missing")
    chosen = [ours for key, ours in _ST_MODES.items() if cfg.get(key)]
    unsupported = [key for key in _ST_UNSUPPORTED if cfg.get(key)]
    if unsupported or len(chosen) != 1:
        raise ConfigError(f"{path}: pagoda pools with exactly one of {sorted(_ST_MODES)}; this file sets "
                          f"{sorted(k for k in (*_ST_MODES, *_ST_UNSUPPORTED) if cfg.get(k))}")
    return chosen[0]


def pool(hidden: torch.Tensor, lengths: torch.Tensor, method: str) -> torch.Tensor:
    """``hidden``: ``[batch, seq, hidden]`` padded on the right; ``lengths``: ``[batch]``. Returns ``[batch,
    hidden]`` in float32."""
    hidden = hidden.float()
    if method == "cls":
        return hidden[:, 0]
    if method == "last":
        return hidden[torch.arange(hidden.shape[0]), lengths - 1]
    mask = (torch.arange(hidden.shape[1])[None, :] < lengths[:, None]).unsqueeze(-1).float()
    return (hidden * mask).sum(1) / lengths[:, None].float()


def pool_packed(hidden: torch.Tensor, lengths: list[int], method: str) -> torch.Tensor:
    """``hidden``: ``[tokens, hidden]``, sequences of ``lengths`` end to end. Returns ``[batch, hidden]`` in
    float32."""
    ends = torch.tensor(lengths).cumsum(0)
    if method == "cls":
        return hidden[ends - torch.tensor(lengths)].float()
    if method == "last":
        return hidden[ends - 1].float()
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    sums = torch.zeros(len(lengths), hidden.shape[-1]).index_add_(0, owner, hidden.float())
    return sums / torch.tensor(lengths, dtype=torch.float32)[:, None]


def finish_embedding(vector: torch.Tensor, normalize: bool, dimensions: Optional[int]) -> torch.Tensor:
    """Normalize (when the model does), cut to ``dimensions`` (Matryoshka) and normalize again."""
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    if dimensions is not None and dimensions < vector.shape[-1]:
        vector = vector[..., :dimensions]
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector
