"""Weight memory of a loaded model, against the same model held in bf16."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pagoda.modeling.layers.linear import Linear


@dataclass(frozen=True)
class WeightMemory:
    linear_bytes: int  # every Linear's parameters and buffers, as stored
    linear_bf16_bytes: int  # the same layers as dense bf16 (weights + biases)
    total_bytes: int  # the whole model's parameters and buffers
    total_bf16_bytes: int  # the whole model with every Linear dense bf16

    def describe(self) -> str:
        return (f"linear weights {self.linear_bytes / 2**20:.1f} MiB vs {self.linear_bf16_bytes / 2**20:.1f} MiB "
                f"in bf16 ({self.linear_bf16_bytes / self.linear_bytes:.2f}x smaller); whole model "
                f"{self.total_bytes / 2**20:.1f} MiB vs {self.total_bf16_bytes / 2**20:.1f} MiB")


def _stored_bytes(module: nn.Module, seen: set[int]) -> int:
    """Parameters and buffers of ``module`` not counted before (tables shared by layers count once)."""
    total = 0
    for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
        key = id(t) if t.is_mkldnn else t.data_ptr()  # a oneDNN-packed weight has no data pointer
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def weight_memory(model: nn.Module) -> WeightMemory:
    """Bytes of ``model``'s stored weights, split into Linear layers and the rest."""
    linear = linear_bf16 = other = 0
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, Linear):
            linear += _stored_bytes(module, seen)
            linear_bf16 += 2 * module.out_features * (module.in_features + (module.bias is not None))
        else:
            other += sum(t.numel() * t.element_size() for t in module.parameters(recurse=False))
    return WeightMemory(linear, linear_bf16, linear + other, linear_bf16 + other)
