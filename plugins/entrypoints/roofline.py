"""How close a run came to this machine's matmul limit, measured on the spot with the model's own shapes.

For every engine step the benchmark records how many tokens went through the
linear layers and how many rows went through the LM head. The roofline time
is what those matmuls alone would have taken at the GEMM speed measured here
for that step's batch size; the fraction is roofline time over actual time
(1.0 would mean the engine did nothing but matmuls at full speed).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from pagoda.layers import onednn
from pagoda.layers.linear import Linear

# batch sizes at which GEMM speed is measured; a step uses the nearest (in log space)
_BUCKETS = (1, 4, 16, 64, 256, 1024, 2048)


@dataclass
class Roofline:
    flops_per_token: int  # linear layers, one token
    flops_per_logit_row: int  # LM head, one row
    seconds_per_flop: dict[int, float]  # batch bucket -> measured seconds per FLOP

    def step_flops(self, num_tokens: int, num_logit_rows: int) -> int:
        return num_tokens * self.flops_per_token + num_logit_rows * self.flops_per_logit_row

    def step_seconds(self, num_tokens: int, num_logit_rows: int) -> float:
        return (num_tokens * self.flops_per_token * self._rate(num_tokens)
                + num_logit_rows * self.flops_per_logit_row * self._rate(max(1, num_logit_rows)))

    def _rate(self, m: int) -> float:
        bucket = min(_BUCKETS, key=lambda b: abs(math.log(b) - math.log(max(1, m))))
        return self.seconds_per_flop[bucket]


def _dense_weights(model: torch.nn.Module) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Dense weights in the model dtype with one decoder layer's linear shapes, and the LM head's.

    Random stand-ins, so that a quantized model is held to the dense GEMM speed of its shapes
    (its packed weights are not what a GEMM reads)."""
    dtype = model.embed_tokens.weight.dtype
    layer_shapes = [(m.out_features, m.in_features) for m in model.layers[0].modules() if isinstance(m, Linear)]
    head = model.embed_tokens.weight if model.lm_head is None else None
    head_shape = tuple(head.shape) if head is not None else (model.lm_head.out_features, model.lm_head.in_features)
    return [torch.randn(shape, dtype=dtype) for shape in layer_shapes], torch.randn(head_shape, dtype=dtype)


@torch.inference_mode()
def measure_roofline(model: torch.nn.Module, num_layers: int) -> Roofline:
    """GEMM speed per batch bucket, on the fastest GEMM pagoda has here: oneDNN with packed weights for bf16
    (what the engine's dense layers run, see ``layers.onednn``), else ``F.linear``."""
    layer_weights, head = _dense_weights(model)
    dtype = head.dtype
    layer_params = sum(w.numel() for w in layer_weights)
    gemms = []
    for w in layer_weights + [head]:
        packed = onednn.pack_weight(w)
        gemms.append((w.shape[1], (lambda x, p=packed: onednn.packed_linear(x, p)) if packed is not None
                      else (lambda x, w=w: torch.nn.functional.linear(x, w))))
    rates = {}
    for m in _BUCKETS:
        xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=dtype) for w in layer_weights + [head]}
        flops = 2 * m * (layer_params + head.numel())
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            for in_features, gemm in gemms:
                gemm(xs[in_features])
            samples.append(time.perf_counter() - start)
        rates[m] = min(samples[1:]) / flops  # the first run warms up
    return Roofline(2 * layer_params * num_layers, 2 * head.numel(), rates)


def report(roofline: Roofline, steps: list[tuple[int, int]], seconds: float) -> str:
    flops = sum(roofline.step_flops(t, r) for t, r in steps)
    ideal = sum(roofline.step_seconds(t, r) for t, r in steps)
    peak = 1.0 / min(roofline.seconds_per_flop.values())
    return (f"matmul: {flops / 1e12:.2f} TFLOP, achieved {flops / seconds / 1e9:.0f} GFLOP/s; GEMM roofline for "
            f"these steps' shapes {ideal:.1f} s ({flops / ideal / 1e9:.0f} GFLOP/s, best bucket "
            f"{peak / 1e9:.0f}) -> {ideal / seconds:.0%} of the roofline")
