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

from pagoda.modeling.layers.linear import Linear

# batch sizes at which GEMM speed is measured; a step uses the nearest (in log space)
_BUCKETS = (1, 4, 16, 64, 256, 1024, 2048)


@dataclass
class Roofline:
    flops_per_token: int  # linear layers, one token
    flops_per_logit_row: int  # LM head, one row
    seconds_per_flop: dict[int, float]  # batch bucket -> measured seconds per FLOP of the layers' GEMMs
    head_seconds_per_flop: dict[int, float]  # the same for the LM head's GEMM

    def step_flops(self, num_tokens: int, num_logit_rows: int) -> int:
        return num_tokens * self.flops_per_token + num_logit_rows * self.flops_per_logit_row

    def step_seconds(self, num_tokens: int, num_logit_rows: int) -> float:
        return (num_tokens * self.flops_per_token * _rate(self.seconds_per_flop, num_tokens)
                + num_logit_rows * self.flops_per_logit_row * _rate(self.head_seconds_per_flop, num_logit_rows))

    @property
    def peak_flops(self) -> float:
        return 1.0 / min(min(self.seconds_per_flop.values()), min(self.head_seconds_per_flop.values()))


def _rate(rates: dict[int, float], m: int) -> float:
    bucket = min(_BUCKETS, key=lambda b: abs(math.log(b) - math.log(max(1, m))))
    return rates[bucket]


# distinct stand-in layers at most (bytes of dense weights): far beyond any L3, so small batches stream their
# weights from memory as the engine must, without holding a second copy of a large model
_STAND_IN_BYTES = 256 << 20


def _dense_weights(model: torch.nn.Module, num_layers: int) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Dense weights in the model dtype with the decoder layers' linear shapes (as many distinct layers as
    ``_STAND_IN_BYTES`` allows, up to ``num_layers``), and the LM head's.

    Random stand-ins, so that a quantized model is held to the dense GEMM speed of its shapes
    (its packed weights are not what a GEMM reads)."""
    dtype = model.embed_tokens.weight.dtype
    layer_shapes = [(m.out_features, m.in_features) for m in model.layers[0].modules() if isinstance(m, Linear)]
    head = model.embed_tokens.weight if model.lm_head is None else None
    head_shape = tuple(head.shape) if head is not None else (model.lm_head.out_features, model.lm_head.in_features)
    layer_bytes = sum(o * i for o, i in layer_shapes) * torch.finfo(dtype).bits // 8
    distinct = max(1, min(num_layers, _STAND_IN_BYTES // max(1, layer_bytes)))
    layers = [[torch.randn(shape, dtype=dtype) for shape in layer_shapes] for _ in range(distinct)]
    return layers, torch.randn(head_shape, dtype=dtype)


@torch.inference_mode()
def measure_roofline(model: torch.nn.Module, num_layers: int, rounds: int = 5) -> Roofline:
    """GEMM speed per batch bucket, on the fastest GEMM pagoda has here: oneDNN with packed weights for bf16
    (what the engine's dense layers run, see ``layers.onednn``), else the model's own kernels' linear (on AVX2
    the widened-tile GEMM; ``F.linear`` for other dtypes), else ``F.linear``.

    A roofline in both senses: up to 64 rows a bucket runs the GEMMs of every decoder layer (distinct
    weights, up to 256 MB of them), so that it pays for streaming the weights from memory as a decode step
    must; from 256 rows, where the GEMMs are compute-bound, one layer's. Timing one layer's weights over
    and over had held small batches to a speed no step can reach (the weights sat in cache).
    The decoder layers' GEMMs and the LM head's are timed apart: the engine runs the head over a few rows
    a step, never over a whole prompt, and a 2048-row head (its output alone 200 MB) is slower per FLOP
    than the layers at 2048 rows. Every bucket is timed once per round, rounds interleaved, and the
    fastest round counts: one pass per bucket gave rates 2x apart between runs on this shared machine.
    """
    layers, head = _dense_weights(model, num_layers)
    dtype = head.dtype

    kernels = getattr(model, "kernels", None)  # the model's CPU kernels: whether its engine packs bf16 weights

    def gemm(w: torch.Tensor):
        packed = kernels.pack_weight(w) if kernels is not None else None
        if packed is not None:
            return lambda x: kernels.packed_linear(x, packed)
        if kernels is not None:
            # the model's own linear: on a CPU without bf16 math, its widened-tile GEMM, far faster than torch's
            return lambda x: kernels.linear(x, w)
        return lambda x: torch.nn.functional.linear(x, w)

    layer_flops = 2 * sum(w.numel() for w in layers[0])
    layer_gemms = [[(w.shape[1], gemm(w)) for w in layer] for layer in layers]
    del layers  # the packed copies are what runs
    head_gemm = [(head.shape[1], gemm(head))]
    in_sizes = {k for k, _ in layer_gemms[0]} | {head.shape[1]}
    inputs = {m: {k: torch.randn(m, k, dtype=dtype) for k in in_sizes} for m in _BUCKETS}
    best: dict[tuple[str, int], float] = {}
    for _ in range(rounds):
        for m in _BUCKETS:
            streamed = layer_gemms if m <= 64 else layer_gemms[:1]
            for kind, gemms, flops in (("layers", [g for layer in streamed for g in layer], len(streamed) * m * layer_flops),
                                       ("head", head_gemm, m * 2 * head.numel())):
                for timed in (False, True):  # the untimed pass warms up (a one-layer set stays in cache)
                    start = time.perf_counter()
                    for in_features, fn in gemms:
                        fn(inputs[m][in_features])
                    if timed:
                        rate = (time.perf_counter() - start) / flops
                        best[kind, m] = min(best.get((kind, m), math.inf), rate)
    return Roofline(layer_flops * num_layers, 2 * head.numel(),
                    {m: best["layers", m] for m in _BUCKETS}, {m: best["head", m] for m in _BUCKETS})


def report(roofline: Roofline, steps: list[tuple[int, int]], seconds: float) -> str:
    flops = sum(roofline.step_flops(t, r) for t, r in steps)
    ideal = sum(roofline.step_seconds(t, r) for t, r in steps)
    peak = roofline.peak_flops
    return (f"matmul: {flops / 1e12:.2f} TFLOP, achieved {flops / seconds / 1e9:.0f} GFLOP/s; GEMM roofline for "
            f"these steps' shapes {ideal:.1f} s ({flops / ideal / 1e9:.0f} GFLOP/s, best bucket "
            f"{peak / 1e9:.0f}) -> {ideal / seconds:.0%} of the roofline")
