"""What every quant method shares: checkpoint-name matching, shard-aware loaders, config checks."""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from pagoda.errors import CheckpointError, ConfigError
from pagoda.host.env import QUANT_KERNELS, resolve_host_config

# the Llama family's fused layers and the checkpoint modules stacked into them, in shard order; a model being
# built sets its own (its architecture's packed_modules_mapping), which checkpoint_modules reads
FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_modules(prefix: str) -> list[str]:
    """``model.layers.0.self_attn.qkv_proj`` -> the checkpoint modules fused into it (q/k/v_proj), as the
    architecture being built packs them (:func:`pagoda.modeling.layers.linear.current_packed_modules`)."""
    from pagoda.modeling.layers.linear import current_packed_modules

    packed = current_packed_modules()
    parent, _, leaf = prefix.rpartition(".")
    if leaf in packed:
        return [f"{parent}.{name}" for name in packed[leaf]]
    return [prefix]


def name_matches(module: str, pattern: str) -> bool:
    """compressed-tensors / vLLM style target: ``re:<regex>``, a full module name, or its last part(s)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def is_skipped(prefix: str, predicate: Callable[[str], bool], method: str) -> bool:
    """True when every checkpoint module of ``prefix`` is excluded; a fused layer half excluded is an error."""
    flags = [predicate(m) for m in checkpoint_modules(prefix)]
    if any(flags) and not all(flags):
        raise ConfigError(
            f"the {method} config quantizes only some of {checkpoint_modules(prefix)}, which pagoda fuses into "
            f"{prefix}; quantize all of them or none"
        )
    return all(flags)


def kernel_for_device(choice: Optional[str] = None) -> str:
    """The int kernel for ``choice`` (an engine's ``quant_kernel`` host setting; default: the environment's):
    ``auto`` is ``triton`` on a GPU and ``cpu`` (C++) otherwise.

    ``torch`` (dequantize a layer per forward, then multiply) stays selectable as the reference.
    """
    if choice is None:
        choice = resolve_host_config().quant_kernel
    if choice not in QUANT_KERNELS:
        raise ConfigError(f"quant_kernel {choice!r} is not one of {', '.join(QUANT_KERNELS)}")
    if choice == "auto":
        return "triton" if torch.cuda.is_available() else "cpu"
    return choice


def config_value(cfg: dict[str, Any], keys: Iterable[str], default: Any) -> Any:
    """First of ``keys`` present in ``cfg`` (formats spell fields differently), else ``default``."""
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    return default


def check_group_size(group_size: Any, method: str) -> int:
    """-1 (one group spanning the whole input) or a power of two >= 8, as the tools write."""
    if not isinstance(group_size, int) or (group_size != -1 and (group_size < 8 or group_size & (group_size - 1))):
        raise ConfigError(
            f"{method} group_size {group_size!r} is not supported; expected -1 (one group per output channel) "
            "or a power of two >= 8 such as 32, 64 or 128"
        )
    return group_size


def add_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
              loader: Callable[..., None], fill: float = 0) -> nn.Parameter:
    """Register a checkpoint-layout parameter (filled with ``fill``) whose weight_loader is ``loader``."""
    param = nn.Parameter(torch.full(shape, fill, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    layer.register_parameter(name, param)
    return param


def output_sharded_loader(layer: nn.Module, method: str, out_dim: int, pack: int = 1,
                          expected_dtype: Optional[torch.dtype] = None,
                          in_pack: Optional[int] = None) -> Callable[..., None]:
    """Loader for a tensor whose dim ``out_dim`` runs over output channels (divided by ``pack``).

    A fused layer's shard ``i`` lands at ``shard_offset(i) / pack`` along
    that dim; any other shape mismatch is an error naming the tensor. Under
    tensor parallelism the rank keeps its part first (:func:`tp_part`; the other
    dim of a 2-D tensor runs over input features, ``in_pack`` per entry, or over
    nothing to split when ``in_pack`` is None).
    """

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int], name: str) -> None:
        loaded = tp_part(layer, loaded, shard_id, out_dim, pack, in_pack, method)
        target = param.data
        if shard_id is not None:
            start, size = layer.shard_offset(shard_id)
            if start % pack or size % pack:
                raise ConfigError(f"{layer.prefix}: shard {shard_id} of {size} channels is not a multiple of the "
                                  f"{pack} channels {method} packs per int32; this layer cannot be fused")
            target = target.narrow(out_dim, start // pack, size // pack)
        check_tensor(loaded, tuple(target.shape), expected_dtype, name, method, layer)
        target.copy_(loaded.to(target.dtype))
        mark_loaded(layer, name)

    # how a checkpoint that stores the fused layer itself is cut into its shards (the dense loader reads these)
    load.out_dim, load.out_pack = out_dim, pack
    return load


def tp_part(layer: nn.Module, loaded: torch.Tensor, shard_id: Optional[int], out_dim: int, out_pack: int,
            in_pack: Optional[int], method: str) -> torch.Tensor:
    """This rank's part of a checkpoint tensor: its output rows (column parallelism, ``layer.tp_rows``) along
    ``out_dim``, ``out_pack`` channels per entry, or its input columns (row parallelism, ``layer.tp_cols``)
    along the other dim, ``in_pack`` features per entry. A part that does not fall on whole entries (a
    packed word or a scale group split between ranks) is refused."""
    rows, cols = getattr(layer, "tp_rows", None), getattr(layer, "tp_cols", None)
    if rows is not None:
        start, size = rows[shard_id or 0]
        if start % out_pack or size % out_pack:
            raise ConfigError(f"{layer.prefix}: this rank's {size} output channels from {start} split the "
                              f"{out_pack}-channel words {method} packs; use another tensor_parallel_size")
        loaded = loaded.narrow(out_dim, start // out_pack, size // out_pack)
    if cols is not None and in_pack is not None and loaded.dim() == 2:
        start, size = cols
        if start % in_pack or size % in_pack:
            raise ConfigError(f"{layer.prefix}: this rank's {size} input features from {start} split {method}'s "
                              f"groups or words of {in_pack}; use another tensor_parallel_size, or a checkpoint "
                              f"whose group size divides {size}")
        loaded = loaded.narrow(1 - out_dim, start // in_pack, size // in_pack)
    return loaded


def per_shard_loader(layer: nn.Module, method: str, expected_dtype: Optional[torch.dtype] = None,
                     squeeze_scalar: bool = False, per_input: bool = False) -> Callable[..., None]:
    """Loader for a parameter stacked ``[num_shards, ...]``: one slot per checkpoint tensor (g_idx, scalars);
    ``per_input``: the tensor runs over input features (g_idx), of which a row-parallel rank keeps its own."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int], name: str) -> None:
        cols = getattr(layer, "tp_cols", None)
        if per_input and cols is not None:
            loaded = loaded.narrow(0, *cols)
        target = param.data[shard_id or 0]
        if squeeze_scalar and loaded.numel() == 1 and target.numel() == 1:
            loaded = loaded.reshape(target.shape)
        check_tensor(loaded, tuple(target.shape), expected_dtype, name, method, layer)
        target.copy_(loaded.to(target.dtype))
        mark_loaded(layer, name)

    load.same_for_every_shard = True  # a fused layer's one tensor (g_idx, a scalar) fills every shard's slot
    return load


def check_tensor(loaded: torch.Tensor, shape: tuple[int, ...], dtype: Optional[torch.dtype], name: str,
                 method: str, layer: nn.Module) -> None:
    if tuple(loaded.shape) != shape:
        raise CheckpointError(
            f"tensor {name!r} has shape {tuple(loaded.shape)} but {method} expects {shape} for {layer.prefix} "
            f"(in_features={layer.in_features}, out_features={layer.out_features}); the checkpoint does not "
            "match its config.json / quantization config"
        )
    if dtype is not None and loaded.dtype != dtype:
        raise CheckpointError(
            f"tensor {name!r} has dtype {loaded.dtype} but {method} expects {dtype} for {layer.prefix}; "
            "the checkpoint was not written in this format"
        )


def mark_loaded(layer: nn.Module, name: str) -> None:
    """Remember which checkpoint tensors arrived, for optional ones (g_idx) checked after loading."""
    layer.__dict__.setdefault("quant_loaded", set()).add(name.rsplit(".", 1)[-1] + "#" + name)


def loaded_suffix(layer: nn.Module, suffix: str) -> bool:
    return any(key.startswith(suffix + "#") for key in layer.__dict__.get("quant_loaded", ()))


def shard_rows(layer: nn.Module) -> list[tuple[int, int]]:
    """``[(row_start, row_end)]`` of each fused shard (one entry for an unfused layer)."""
    rows = []
    for i in range(len(layer.output_sizes)):
        start, size = layer.shard_offset(i)
        rows.append((start, start + size))
    return rows


def drop_params(layer: nn.Module, *names: str) -> None:
    """Free checkpoint-layout parameters once converted to the runtime layout."""
    for name in names:
        if name in layer._parameters:
            del layer._parameters[name]
