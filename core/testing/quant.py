"""Quantization method checks: quantized linear layers against their dequantized reference."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from pagoda.errors import CheckpointError
from pagoda.interfaces import QuantMethodFactory
from pagoda.testing.attention import AttentionCase, component_configs
from pagoda.testing.contract import Where

# make_tensors(out_features, in_features, generator) -> ({parameter name: checkpoint tensor}, dense reference
# [out_features, in_features] float32): one output shard as a checkpoint stores it
MakeTensors = Callable[[int, int, torch.Generator], tuple[dict[str, torch.Tensor], torch.Tensor]]

# (layer name, output shards): a fused projection of two shards (as gate/up) and a plain one
LAYERS = (("model.layers.0.mlp.gate_up_proj", (64, 160)), ("model.layers.0.self_attn.o_proj", (96,)))


def check_quant_method(factory: QuantMethodFactory, quant_config: Optional[dict] = None,
                       make_tensors: Optional[MakeTensors] = None, in_features: int = 256,
                       dtype: torch.dtype = torch.float32, tolerance: Optional[float] = None, seed: int = 0) -> None:
    """Check a ``pagoda_quant_methods`` factory, built as ``factory(model_config, quant_config)``.

    For a fused and a plain linear layer (``LAYERS``), with and without bias: ``for_layer`` gives the
    method, ``create_weights`` registers parameters that each carry a ``weight_loader``, the checkpoint
    tensors load shard by shard, ``process_weights_after_loading`` runs, and the layer's output for 1, 3 and
    17 rows is within ``tolerance`` (relative Frobenius error) of ``x @ W.T + bias``.

    A checkpoint format passes ``make_tensors``, which quantizes a random shard and returns its tensors and
    their dequantized weights ``W`` (default tolerance 1e-2: only rounding of activations and sums). An
    online method (no ``make_tensors``) is given dense ``weight`` shards and held to the dense weights
    (default tolerance 0.08: the method's own quantization error). Raises ContractError."""
    from pagoda.modeling.layers.linear import Linear

    name = getattr(factory, "__name__", repr(factory))
    mc, _ = component_configs(AttentionCase(1, 1, 64, 16, (0,), (1,)), dtype)
    method = factory(mc, dict(quant_config or {}))
    tolerance = tolerance if tolerance is not None else (1e-2 if make_tensors is not None else 0.08)
    gen = torch.Generator().manual_seed(seed)
    checked = 0
    for prefix, shards in LAYERS:
        for bias in (False, True):
            linear_method = method.for_layer(prefix)
            if linear_method is None:
                continue
            where = Where(name, seed, f"{prefix}: shards {list(shards)}, in_features {in_features}, bias {bias}")
            layer = Linear(in_features, shards, bias, dtype, linear_method, prefix)
            missing = [n for n, p in layer.named_parameters() if not hasattr(p, "weight_loader")]
            if missing:
                raise where.at("create_weights", "stage").fail(
                    "create_weights()", f"parameters {missing} have no weight_loader",
                    "every parameter a method registers carries a weight_loader",
                    "the linear method's create_weights()")
            reference = _load(layer, shards, in_features, make_tensors, gen, where)
            b = None
            if bias:
                b = torch.randn(layer.out_features, generator=gen)
                layer.bias.weight_loader(layer.bias, b, None, f"{prefix}.bias")
            layer.process_weights_after_loading()
            for rows in (1, 3, 17):
                x = torch.randn(rows, in_features, generator=gen).to(dtype)
                with torch.inference_mode():
                    got = layer(x)
                want = x.float() @ reference.T + (b.to(dtype).float() if b is not None else 0)
                if tuple(got.shape) != tuple(want.shape):
                    raise where.at(f"forward of {rows} rows", "stage").fail(
                        "apply()", f"the output has shape {tuple(got.shape)}, not {tuple(want.shape)}",
                        "apply() returns [rows, out_features]", "the linear method's apply()")
                error = float((got.float() - want).norm() / want.norm())
                if not error <= tolerance:
                    raise where.at(f"forward of {rows} rows", "stage").fail(
                        "apply()", f"the output is {error:.4f} (relative) from the reference x @ W.T"
                        f"{' + bias' if bias else ''}, more than {tolerance}",
                        "the layer computes x @ W.T + bias with the checkpoint's (dequantized) weights",
                        "the linear method's apply() or process_weights_after_loading() (or make_tensors)")
            checked += 1
    if not checked:
        raise Where(name, seed).fail("for_layer()", f"for_layer returned None for every layer checked "
                                     f"({[p for p, _ in LAYERS]})", "a method quantizes some layer",
                                     "the quant method's for_layer()")


def _load(layer, shards: tuple[int, ...], in_features: int, make_tensors: Optional[MakeTensors],
          gen: torch.Generator, where: Where) -> torch.Tensor:
    """Load every shard's checkpoint tensors through the weight loaders; the dense reference, shards stacked."""
    references = []
    for shard_id, size in enumerate(shards):
        if make_tensors is None:
            weight = torch.randn(size, in_features, generator=gen) / in_features ** 0.5
            tensors, reference = {"weight": weight}, weight
        else:
            tensors, reference = make_tensors(size, in_features, gen)
        references.append(reference.float())
        shard = shard_id if len(shards) > 1 else None
        for param_name, tensor in tensors.items():
            param = getattr(layer, param_name, None)
            if param is None:
                raise where.at(f"load of shard {shard_id}", "stage").fail(
                    "create_weights()", f"the layer has no parameter {param_name!r} for a checkpoint tensor; it has "
                    f"{[n for n, _ in layer.named_parameters()]}", "create_weights registers a parameter for every "
                    "checkpoint tensor of the format", "the linear method's create_weights()")
            try:
                param.weight_loader(param, tensor, shard, f"{layer.prefix}.{param_name}")
            except CheckpointError as exc:
                raise where.at(f"load of shard {shard_id}", "stage").fail(
                    f"the weight_loader of {param_name!r}", f"loading failed: {exc}",
                    "each shard's checkpoint tensors load through the parameter's weight_loader",
                    "the weight_loader the linear method set in create_weights()") from None
    return torch.cat(references)
