"""Round-to-nearest group-wise quantization of a dense safetensors checkpoint into a GPTQ, AWQ or
compressed-tensors checkpoint.

    .venv/bin/python contrib/quant-tools/quantize_rtn.py OUT [--src DIR] [--bits 4] [--group 64] [--channel] \
        [--asym] [--act-order] [--format gptq|awq|compressed|compressed-int8] [--reference]

No calibration data and no tool beyond pagoda and torch: every linear of the
decoder layers (a Mixture-of-Experts model's experts and shared expert too,
not its router nor the shared expert's one-output gate) is
cut into groups of ``--group`` input columns, and each group gets one scale
(and zero point) from its own minimum and maximum, the way GPTQ's
``find_params`` does before any error feedback. Everything else (embeddings,
norms, a tied or separate LM head) is copied unchanged. SRC defaults to the
default model (SmolLM2-135M-Instruct, converted into pagoda's cache on first
use).

Formats (the tensors pagoda's loaders, vLLM and transformers read):
- ``gptq`` (default): ``qweight``/``qzeros``/``scales``/``g_idx``, symmetric by
  default (zero point 2**(bits-1), ``checkpoint_format: gptq``, which stores
  zero points minus one); ``--asym`` writes ``checkpoint_format: gptq_v2``,
  since a v1 zero point of 0 cannot be stored.
- ``awq``: AutoAWQ's GEMM layout, 4-bit, always with zero points.
- ``compressed``: compressed-tensors "pack-quantized" (llm-compressor's W4A16 /
  W8A16), symmetric: ``weight_packed``/``weight_scale``/``weight_shape``, group
  scales, or one scale per output row with ``--channel``.
- ``compressed-int8``: compressed-tensors "int-quantized" W8A16: an int8
  ``weight`` and one ``weight_scale`` per output row.

``--act-order`` (GPTQ and compressed-tensors pack-quantized, groups) groups each linear's input columns in
descending order of their weights' norm, a stand-in for the Hessian diagonal GPTQ's ``desc_act`` sorts by,
and writes each column's group in ``g_idx`` / ``weight_g_idx`` (``desc_act: true``, ``actorder: group``).

Writes OUT/reference/dequant.safetensors (every quantized linear dequantized,
float32 ``[out, in]``); ``--reference`` also writes reference/generations.json
(greedy tokens of transformers on those dequantized weights), so
compare_with_reference.py can check pagoda against it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from pagoda.plugins.quant.packing import pack_awq, pack_int32

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
           "self_attn.qkv_proj", "mlp.gate_up_proj",  # Phi-3 stores these two fused
           "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")  # Qwen2-MoE
# a Mixture-of-Experts checkpoint's experts, one tensor per expert and projection (Mixtral's w1/w2/w3, Qwen-MoE's)
EXPERT = re.compile(r"\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
          "special_tokens_map.json")


def quantize_rtn(w: torch.Tensor, bits: int, group: int, sym: bool):
    """``w [out, in]`` -> (q ``[out, in]`` int64 in [0, 2**bits), scales fp16 ``[out, G]``, zeros int64 ``[out, G]``).

    The last group may be shorter than ``group`` (``G = ceil(in / group)``). Scales are rounded to fp16
    before the weights are divided by them, so ``dequantize`` gives exactly what a runtime computes.
    """
    out_features, in_features = w.shape
    num_groups = -(-in_features // group)
    maxq = (1 << bits) - 1
    padded = torch.nn.functional.pad(w.float(), (0, num_groups * group - in_features))
    cols = padded.view(out_features, num_groups, group)  # [out, G, group]; padding zeros change no min/max
    hi, lo = cols.amax(-1).clamp(min=0), cols.amin(-1).clamp(max=0)  # [out, G]; 0 always representable
    if sym:
        hi = torch.maximum(hi, -lo)
        lo = -hi
    scales = ((hi - lo) / maxq).clamp(min=1e-8).half()
    scales = torch.where(scales == 0, torch.full_like(scales, 2 ** -24), scales)  # fp16 underflow
    if sym:
        zeros = torch.full_like(scales, (maxq + 1) // 2, dtype=torch.int64)
    else:
        zeros = torch.round(-lo / scales.float()).clamp(0, maxq).long()
    s_col = scales.float().repeat_interleave(group, 1)[:, :in_features]
    z_col = zeros.repeat_interleave(group, 1)[:, :in_features]
    q = torch.clamp(torch.round(w.float() / s_col) + z_col, 0, maxq).long()
    return q, scales, zeros


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """float32 ``[out, in]``: ``(q - zero) * scale`` of each column's group (``g_idx``)."""
    return (q.float() - zeros.float()[:, g_idx]) * scales.float()[:, g_idx]


def quantize_act_order(w: torch.Tensor, bits: int, group: int, sym: bool):
    """:func:`quantize_rtn` over ``w``'s columns taken in descending order of their norm, as (q ``[out, in]`` in
    ``w``'s column order, scales, zeros ``[out, G]``, g_idx ``[in]``: each column's group)."""
    order = torch.argsort(w.float().norm(dim=0), descending=True, stable=True)
    q_sorted, scales, zeros = quantize_rtn(w[:, order], bits, group, sym)
    q, g_idx = torch.empty_like(q_sorted), torch.empty(w.shape[1], dtype=torch.int64)
    q[:, order] = q_sorted
    g_idx[order] = torch.arange(w.shape[1]) // group
    return q, scales, zeros, g_idx


def gptq_tensors(q, scales, zeros, bits: int, g_idx: torch.Tensor, zero_offset: int) -> dict[str, torch.Tensor]:
    """GPTQ layout: qweight ``[in * b / 32, out]``, qzeros ``[G, out * b / 32]``, scales ``[G, out]``, g_idx."""
    maxq = (1 << bits) - 1
    return {"qweight": pack_int32(q.t(), bits, dim=0),
            "qzeros": pack_int32(((zeros - zero_offset) & maxq).t(), bits, dim=1),
            "scales": scales.t().contiguous(),
            "g_idx": g_idx.to(torch.int32)}


def awq_tensors(q, scales, zeros) -> dict[str, torch.Tensor]:
    """AWQ GEMM layout: qweight ``[in, out / 8]``, qzeros ``[G, out / 8]``, scales ``[G, out]``."""
    return {"qweight": pack_awq(q.t()), "qzeros": pack_awq(zeros.t()), "scales": scales.t().contiguous()}


def compressed_tensors(q, scales, bits: int, fmt: str, in_features: int,
                       g_idx: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """compressed-tensors layouts of symmetric ``q`` (offset by ``2**(bits-1)``): pack-quantized
    ``weight_packed [out, in * b / 32]`` / ``weight_scale [out, G]`` / ``weight_shape`` (and ``weight_g_idx`` in
    act-order), or int-quantized ``weight`` int8 ``[out, in]`` / ``weight_scale [out, 1]``."""
    signed = q - (1 << (bits - 1))
    if fmt == "compressed-int8":
        return {"weight": signed.to(torch.int8), "weight_scale": scales.float()}
    per_word = 32 // bits
    padded = torch.nn.functional.pad(q, (0, -in_features % per_word), value=1 << (bits - 1))
    packed = {"weight_packed": pack_int32(padded, bits, dim=1), "weight_scale": scales.float(),
              "weight_shape": torch.tensor([q.shape[0], in_features], dtype=torch.int64)}
    return packed if g_idx is None else {**packed, "weight_g_idx": g_idx.to(torch.int32)}


def check_shapes(name: str, w: torch.Tensor, bits: int, group: int, fmt: str) -> None:
    out_features, in_features = w.shape
    per_word = 32 // bits
    if fmt == "gptq" and (in_features % per_word or out_features % per_word):
        sys.exit(f"{name} is [{out_features}, {in_features}]: {bits}-bit GPTQ needs both divisible by {per_word}")
    if fmt == "awq" and (out_features % 8 or in_features % group):
        sys.exit(f"{name} is [{out_features}, {in_features}]: AWQ needs out divisible by 8 and in by the group "
                 f"size {group}; pass a --group that divides {in_features} or use --format gptq")


def quant_config(fmt: str, bits: int, group: int, sym: bool, channel: bool = False, act_order: bool = False) -> dict:
    if fmt.startswith("compressed"):
        weights = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "channel" if channel else "group",
                   "group_size": None if channel else group, "dynamic": False,
                   "actorder": "group" if act_order else None}
        # the routers and Qwen2-MoE's one-output shared-expert gate stay unquantized, as llm-compressor leaves them
        return {"quant_method": "compressed-tensors",
                "format": "int-quantized" if fmt == "compressed-int8" else "pack-quantized",
                "ignore": ["lm_head", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$", "re:.*shared_expert_gate$"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}}}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    return {"quant_method": "gptq", "bits": bits, "group_size": -1 if channel else group, "desc_act": act_order,
            "sym": sym, "checkpoint_format": "gptq" if sym else "gptq_v2"}


def convert(src: Path, out: Path, bits: int, group: int, sym: bool, fmt: str,
            channel: bool = False, act_order: bool = False) -> dict[str, torch.Tensor]:
    """Write the quantized checkpoint to ``out``; returns the dequantized linears (float32 ``[out, in]``).
    ``channel``: one scale per output row (compressed-tensors' channel strategy); ``act_order``: groups of columns
    in descending order of their norm, with a g_idx."""
    if fmt == "awq" and (bits != 4 or sym):
        sys.exit("AWQ checkpoints are 4-bit with zero points: drop --bits/--sym or use --format gptq")
    if fmt.startswith("compressed") and not sym:
        sys.exit("compressed-tensors checkpoints are written symmetric here: drop --asym")
    if fmt == "compressed-int8" and (bits != 8 or not channel):
        sys.exit("--format compressed-int8 is int8 with one scale per output row: pass --bits 8 --channel")
    if channel and fmt == "awq":
        sys.exit("--channel is for GPTQ (group_size -1) and the compressed-tensors formats; AWQ takes a --group")
    if act_order and (channel or fmt not in ("gptq", "compressed")):
        sys.exit("--act-order orders the columns of groups: use it with --format gptq or compressed and a --group")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        sys.exit(f"{src} has no *.safetensors files; pass --src a dense Hugging Face checkpoint directory")
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    dequant: dict[str, torch.Tensor] = {}
    for file in files:
        for key, value in load_file(str(file)).items():
            module = key[: -len(".weight")]
            if not (key.endswith(".weight") and (module.endswith(LINEARS) or EXPERT.search(module))):
                tensors[key] = value
                continue
            check_shapes(key, value, bits, group, fmt)
            cols = value.shape[1] if channel else group
            if act_order:
                q, scales, zeros, g_idx = quantize_act_order(value, bits, cols, sym)
            else:
                (q, scales, zeros), g_idx = quantize_rtn(value, bits, cols, sym), torch.arange(value.shape[1]) // cols
            if fmt == "awq":
                packed = awq_tensors(q, scales, zeros)
            elif fmt.startswith("compressed"):
                packed = compressed_tensors(q, scales, bits, fmt, value.shape[1], g_idx if act_order else None)
            else:
                packed = gptq_tensors(q, scales, zeros, bits, g_idx, zero_offset=1 if sym else 0)
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in packed.items()})
            dequant[key] = dequantize(q, scales, zeros, g_idx)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config(fmt, bits, group, sym, channel, act_order)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in COPIED:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    (out / "reference").mkdir(exist_ok=True)
    save_file(dequant, str(out / "reference" / "dequant.safetensors"))
    return dequant


def write_reference(src: Path, out: Path, dequant: dict[str, torch.Tensor]) -> None:
    """transformers (float32) on the source checkpoint with every linear replaced by its dequantized weight."""
    from reference_generations import write_reference_generations
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for name, w in dequant.items():
            model.get_parameter(name).copy_(w)
    write_reference_generations(model, out, out)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write the quantized checkpoint to")
    parser.add_argument("--src", type=Path, default=None, help="dense checkpoint directory (default: the default "
                        "model, SmolLM2-135M-Instruct)")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--group", type=int, default=64, help="input columns per scale (default 64)")
    parser.add_argument("--asym", action="store_true", help="a zero point per group (default: symmetric)")
    parser.add_argument("--format", choices=("gptq", "awq", "compressed", "compressed-int8"), default="gptq")
    parser.add_argument("--channel", action="store_true", help="one scale per output row instead of groups "
                        "(GPTQ's group_size -1; not for AWQ)")
    parser.add_argument("--act-order", action="store_true", help="groups of columns in descending order of their "
                        "norm, with a g_idx (GPTQ desc_act, compressed-tensors actorder: group)")
    parser.add_argument("--reference", action="store_true",
                        help="also write reference/generations.json with transformers (slower)")
    args = parser.parse_args(argv)
    if args.group < 8 or args.group & (args.group - 1):
        parser.error(f"--group {args.group}: use a power of two >= 8 (32, 64, 128), as GPTQ and AWQ loaders expect")
    if args.src is None:
        from pagoda.modeling.default_model import ensure_default_model

        args.src = ensure_default_model()
    sym = not args.asym and args.format != "awq"
    dequant = convert(args.src, args.out, args.bits, args.group, sym, args.format, args.channel, args.act_order)
    if args.reference:
        sys.path.insert(0, str(Path(__file__).parent))
        write_reference(args.src, args.out, dequant)
    print(f"wrote {args.out}: {len(dequant)} linears, {args.bits}-bit {args.format}, "
          f"{'one scale per row' if args.channel else f'group {args.group}'}, "
          f"{'symmetric' if sym else 'asymmetric'}{', act-order' if args.act_order else ''}")


if __name__ == "__main__":
    main()
