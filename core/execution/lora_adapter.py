"""Reading a PEFT LoRA adapter from disk and checking it against the model it is meant for.

A PEFT directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``target_modules``) and
``adapter_model.safetensors`` with, per adapted projection, ``base_model.model.<module>.lora_A.weight``
``[r, in]`` and ``...lora_B.weight`` ``[out, r]``. The model's fused projections (QKV, gate/up) take the
adapter's pieces as slices of their output: ``q_proj`` is slice 0 of ``qkv_proj``, ``up_proj`` slice 1 of
``gate_up_proj``.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from pagoda.errors import InvalidRequestError
from pagoda.execution.lora_request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRATarget:
    """A linear layer of the model an adapter may adapt: its input width and its output slices."""

    in_features: int
    output_sizes: tuple[int, ...]


@dataclass
class LoRAAdapter:
    """One adapter's weights in memory (CPU), per fused layer prefix and output slice.

    ``lora_a[prefix][i]``: ``[rank, in]`` for slice ``i`` (None where the adapter leaves the slice alone);
    ``lora_b[prefix][i]``: ``[out_i, rank]`` with the adapter's scaling already applied.
    """

    request: LoRARequest
    rank: int
    scaling: float
    lora_a: dict[str, list[Optional[torch.Tensor]]] = field(default_factory=dict)
    lora_b: dict[str, list[Optional[torch.Tensor]]] = field(default_factory=dict)

    def __getstate__(self) -> dict:
        # sent to the other tensor-parallel ranks by value, its tensors in one buffer: pickled for another process,
        # each tensor would otherwise become a shared-memory handle, a file descriptor each (hundreds per adapter)
        buffer = io.BytesIO()
        torch.save({"lora_a": self.lora_a, "lora_b": self.lora_b}, buffer)
        return {**self.__dict__, "lora_a": None, "lora_b": None, "weights": buffer.getvalue()}

    def __setstate__(self, state: dict) -> None:
        weights = torch.load(io.BytesIO(state.pop("weights")), weights_only=True)
        self.__dict__.update(state)
        self.lora_a, self.lora_b = weights["lora_a"], weights["lora_b"]


def load_adapter(request: LoRARequest, targets: dict[str, LoRATarget], packed: dict[str, list[str]],
                 max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check the adapter ``request`` names; raise :class:`InvalidRequestError` saying what is wrong
    with it (a missing file, a rank over ``max_rank``, a target the model lacks, a misshapen tensor).

    ``targets``: the model's adaptable layers by prefix (``model.layers.0.self_attn.qkv_proj``); ``packed``:
    fused layer name -> the checkpoint projections it stacks (``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``).
    """
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    config = _read_config(Path(request.lora_path), where)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise InvalidRequestError(f"{where}: adapter_config.json has r={rank!r}; the rank must be a positive integer")
    if rank > max_rank:
        raise InvalidRequestError(f"{where} has rank {rank}, over this engine's --max-lora-rank {max_rank}; restart "
                                  f"the engine with --max-lora-rank {rank} or more, or use an adapter of rank "
                                  f"<= {max_rank}")
    for key, what in (("use_dora", "DoRA adapters"), ("rank_pattern", "per-module ranks (rank_pattern)"),
                      ("alpha_pattern", "per-module alphas (alpha_pattern)"),
                      ("modules_to_save", "fully trained modules (modules_to_save)")):
        if config.get(key):
            raise InvalidRequestError(f"{where} uses {what}, which pagoda does not serve; use a plain LoRA adapter")
    if config.get("bias", "none") != "none":
        raise InvalidRequestError(f"{where} trains biases (bias={config['bias']!r}), which pagoda does not serve; "
                                  "use an adapter saved with bias='none'")
    slice_of = {piece: (fused, i) for fused, pieces in packed.items() for i, piece in enumerate(pieces)}
    leaves = {prefix.rsplit(".", 1)[-1] for prefix in targets}
    supported = "/".join(sorted(set(slice_of) | leaves - set(packed)))
    wanted = config.get("target_modules") or []
    for name in wanted if isinstance(wanted, list) else []:  # (a string is a regex: the tensors tell then)
        if name.rsplit(".", 1)[-1] not in set(slice_of) | leaves:
            raise InvalidRequestError(
                f"{where} adapts {name!r}, which this model has no linear layer for; pagoda applies LoRA to the "
                f"{supported} projections of its decoder layers")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_weights(Path(request.lora_path), where)
    adapter = LoRAAdapter(request, rank, scaling)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, kind = _split_name(name, where)
        pairs.setdefault(module, {})[kind] = tensor
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise InvalidRequestError(f"{where}: {module} has {sorted(pair)} but needs both lora_A and lora_B")
        parent, _, leaf = module.rpartition(".")
        fused, index = slice_of.get(leaf, (leaf, 0))
        prefix = f"{parent}.{fused}" if parent else fused
        target = targets.get(prefix)
        if target is None or index >= len(target.output_sizes):
            raise InvalidRequestError(
                f"{where} adapts {module!r}, which this model has no linear layer for; pagoda applies LoRA to the "
                f"{supported} projections of its decoder layers")
        a, b = pair["lora_A"], pair["lora_B"]
        slices = len(target.output_sizes)
        if leaf in packed and slices > 1 and b.shape[0] == sum(target.output_sizes) and tuple(a.shape) == (
                rank, target.in_features):
            # an adapter of the fused layer itself (Phi-3's qkv_proj): one A, and B's rows split into the slices
            adapter.lora_a[prefix] = [a.to(dtype)] * slices
            adapter.lora_b[prefix] = [(part.float() * scaling).to(dtype)
                                      for part in b.split(list(target.output_sizes), dim=0)]
            continue
        want_a, want_b = (rank, target.in_features), (target.output_sizes[index], rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise InvalidRequestError(
                f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, but this model needs "
                f"{want_a} and {want_b} (rank {rank}); the adapter was trained for another model")
        adapter.lora_a.setdefault(prefix, [None] * slices)[index] = a.to(dtype)
        adapter.lora_b.setdefault(prefix, [None] * slices)[index] = (b.float() * scaling).to(dtype)
    if not adapter.lora_a:
        raise InvalidRequestError(f"{where}: {WEIGHTS_FILE} holds no lora_A/lora_B tensors")
    return adapter


def _read_config(path: Path, where: str) -> dict:
    if not path.is_dir():
        raise InvalidRequestError(f"{where}: {path} is not a directory; pass the directory PEFT's save_pretrained "
                                  f"wrote ({CONFIG_FILE} and {WEIGHTS_FILE})")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise InvalidRequestError(f"{where}: {config_path} is missing; a PEFT adapter directory holds {CONFIG_FILE} "
                                  f"and {WEIGHTS_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"{where}: cannot read {config_path}: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidRequestError(f"{where}: {config_path} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise InvalidRequestError(f"{where} is a {peft_type} adapter; pagoda serves LoRA adapters only")
    return config


def _read_weights(path: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        hint = " (adapter_model.bin is not read: save with safe_serialization=True)" if (
            path / "adapter_model.bin").exists() else ""
        raise InvalidRequestError(f"{where}: {weights_path} is missing{hint}")
    try:
        return load_file(str(weights_path))
    except (OSError, SafetensorError) as exc:
        raise InvalidRequestError(f"{where}: cannot read {weights_path}: {exc}") from None


def _split_name(name: str, where: str) -> tuple[str, str]:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> (``model.layers.0.self_attn.q_proj``,
    ``lora_A``)."""
    stem = name.removeprefix(_PREFIX)
    for kind in ("lora_A", "lora_B"):
        for suffix in (f".{kind}.weight", f".{kind}.default.weight"):
            if stem.endswith(suffix):
                return stem[:-len(suffix)], kind
    raise InvalidRequestError(f"{where}: tensor {name!r} is not a LoRA A or B matrix (embedding LoRA, DoRA "
                              "magnitudes and trained biases are not served)")
