"""Decode speed and memory of a Mixture-of-Experts model's routed experts: 4-bit group-quantized experts kept
packed (the int kernel's ``int_moe_experts``; ``packed-act-order``: each expert projection's columns in an order of
its own, as an act-order checkpoint's), or MXFP4 ones (gpt-oss's format, the same call on FP4 codes), or FP8 ones
(one byte a weight, the same call on e4m3 codes; a scale per row, or with ``fp8-block`` per block of ``--group``
rows and columns, as ``quant_method: fp8`` checkpoints store them), against experts held in bf16 (the MoE kernel),
the form such a checkpoint's experts took when they were dequantized at load.

Each step runs every layer's routed experts once for a batch of tokens (decode: one token per request), with
random weights and a random top-k routing per layer; attention and the router are left out, so the figures
are the experts' share of a decode step. Run the variants alternately, one process each (they do not hold
each other's weights):

    python contrib/model-speed/moe_quant_speed.py --variant packed
    python contrib/model-speed/moe_quant_speed.py --variant bf16

``--gpt-oss`` takes gpt-oss-20b's expert shapes (32 experts of 2880 x 2880, 4 active, clamped SwiGLU, expert
biases; 1.6 GB a layer in bf16, so a few ``--layers``):

    python contrib/model-speed/moe_quant_speed.py --gpt-oss --layers 2 --variant mxfp4
    python contrib/model-speed/moe_quant_speed.py --gpt-oss --layers 2 --variant bf16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagoda.host.env import resolve_host_config
from pagoda.modeling.layers.moe import FusedMoE
from pagoda.plugins.quant.fp8_moe import Fp8MoeMethod
from pagoda.plugins.quant.int_moe import IntMoeMethod
from pagoda.plugins.quant.mxfp4 import Mxfp4MoeMethod

# gpt-oss-20b's experts: (experts, active, hidden, intermediate)
GPT_OSS_20B = (32, 4, 2880, 2880)


def build(variant: str, args: argparse.Namespace) -> list[FusedMoE]:
    host = resolve_host_config()
    activation = "clamped_swiglu" if args.gpt_oss else "silu"
    layers = []
    for _ in range(args.layers):
        method = {"packed": lambda: IntMoeMethod(4, args.group, None, "cpu", host, "GPTQ"),
                  "packed-act-order": lambda: IntMoeMethod(4, args.group, None, "cpu", host, "GPTQ", act_order=True),
                  "mxfp4": lambda: Mxfp4MoeMethod("cpu", host), "fp8": lambda: Fp8MoeMethod(-1, 1, "cpu", host, "FP8"),
                  "fp8-block": lambda: Fp8MoeMethod(args.group, args.group, "cpu", host, "FP8"),
                  "bf16": lambda: None}[variant]()
        layer = FusedMoE(args.experts, args.hidden, args.inter, torch.bfloat16, activation=activation,
                         has_bias=args.gpt_oss, host=host, quant_method=method)
        if variant == "bf16":
            layer.w13.data.normal_(0, 0.02)
            layer.w2.data.normal_(0, 0.02)
        for name in ("w13", "w2") if method is not None else ():
            getattr(layer, f"{name}_q").data.random_(0, 256)
            if variant == "mxfp4":  # E8M0 exponents: 2^-9 to 2^-6
                getattr(layer, f"{name}_scales").data.random_(118, 122)
            elif variant.startswith("fp8"):  # e4m3 codes below 2 in magnitude (no NaN), a scale per row or block
                getattr(layer, f"{name}_q").data.bitwise_and_(0xBF)
                getattr(layer, f"{name}_scales").data.uniform_(1e-3, 4e-3)
            else:
                getattr(layer, f"{name}_scales").data.uniform_(1e-3, 4e-3)
                getattr(layer, f"{name}_zeros").data.fill_(8)
            if variant == "packed-act-order":  # [E, parts, in]: a random order per expert and projection
                order = getattr(layer, f"{name}_perm").data
                order.copy_(torch.rand(order.shape).argsort(dim=-1))
        if args.gpt_oss:
            layer.b13.data.normal_(0, 0.02)
            layer.b2.data.normal_(0, 0.02)
        layers.append(layer)
    return layers


def step_seconds(layers: list[FusedMoE], batch: int, args: argparse.Namespace) -> tuple[float, float]:
    """The medians over ``args.steps`` steps of one pass of ``batch`` tokens through every layer's experts: wall
    time, and the process's CPU time (with one thread, what a core of its own would take on a busy machine)."""
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, args.hidden, generator=gen).to(torch.bfloat16)
    routes = []
    for _ in range(args.steps + 2):  # two warm-up steps, routings drawn before the clock starts
        logits = torch.randn(len(layers), batch, args.experts, generator=gen)
        weights, ids = torch.softmax(logits, -1).topk(args.active, dim=-1)
        routes.append([(w / w.sum(-1, keepdim=True), i) for w, i in zip(weights, ids)])
    wall, cpu = [], []
    with torch.inference_mode():
        for n, route in enumerate(routes):
            start, start_cpu = time.perf_counter(), time.process_time()
            for layer, (w, i) in zip(layers, route):
                layer(x, w, i)
            if n >= 2:
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=("packed", "packed-act-order", "mxfp4", "fp8", "fp8-block", "bf16"),
                        required=True)
    parser.add_argument("--gpt-oss", action="store_true",
                        help="gpt-oss-20b's experts: sets --experts, --active, --hidden and --inter")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--active", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.gpt_oss:
        args.experts, args.active, args.hidden, args.inter = GPT_OSS_20B
    torch.set_num_threads(args.threads)
    layers = build(args.variant, args)
    per_expert = layers[0].expert_bytes()
    total = per_expert * args.experts * args.layers
    print(f"{args.variant}: {layers[0].isa_path()}; {per_expert / 2**20:.3f} MiB per expert, experts of "
          f"{args.layers} layers {total / 2**30:.2f} GiB, {args.threads} threads")
    for batch in args.batch:
        wall, cpu = step_seconds(layers, batch, args)
        print(f"{args.variant} batch {batch}: {wall * 1e3:.1f} ms per step, {batch / wall:.1f} tok/s; CPU time "
              f"{cpu * 1e3:.1f} ms per step, {batch / cpu:.1f} tok/s")


if __name__ == "__main__":
    main()
