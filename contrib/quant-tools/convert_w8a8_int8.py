"""Write a compressed-tensors W8A8 int8 checkpoint ("int-quantized") from a dense Hugging Face checkpoint.

    python contrib/quant-tools/convert_w8a8_int8.py SRC OUT            # SRC: a checkpoint directory
    python contrib/quant-tools/convert_w8a8_int8.py default OUT        # pagoda's default model

The layout is what llm-compressor writes for its W8A8 preset (round-to-nearest, no calibration):
every ``*_proj`` linear of the decoder layers becomes ``weight`` int8 ``[out, in]`` and
``weight_scale`` ``[out, 1]`` in the checkpoint's dtype, with compressed-tensors' symmetric int8 range:
``scale = max|w| / 127.5`` per output row (cast to the checkpoint dtype), ``weight = round(w / scale)``
clamped to [-128, 127]; activations are marked dynamic, symmetric, per token. Other tensors are
copied as they are, and ``OUT/reference/dequant.safetensors`` (a subfolder, so loaders skip it) holds
every quantized linear's ``weight * weight_scale`` in float32 for comparisons. Needs torch and
safetensors only (pagoda's venv).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
          "vocab.json", "merges.txt")


def quant_args(dynamic: bool, strategy: str, observer) -> dict:
    return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": None, "num_bits": 8,
            "observer": observer, "observer_kwargs": {}, "scale_dtype": None, "strategy": strategy,
            "symmetric": True, "type": "int", "zp_dtype": None}


def quantization_config() -> dict:
    """``quantization_config`` as llm-compressor 0.14 (compressed-tensors 0.19) writes it for W8A8."""
    group = {"format": "int-quantized", "input_activations": quant_args(True, "token", None),
             "output_activations": None, "targets": ["Linear"],
             "weights": quant_args(False, "channel", "memoryless_minmax")}
    return {"config_groups": {"group_0": group}, "format": "int-quantized", "global_compression_ratio": None,
            "ignore": ["lm_head"], "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}, "version": "0.19.0"}


def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> (int8 weight ``[out, in]``, scale ``[out, 1]`` in ``w``'s dtype)."""
    amax = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-8)
    scale = (amax / 127.5).to(w.dtype)
    q = torch.round(w.float() / scale.float()).clamp(-128, 127).to(torch.int8)
    return q, scale


def convert(src: Path, out: Path) -> dict[str, torch.Tensor]:
    """Write the checkpoint; returns the dequantized float32 weight of every quantized linear (by tensor name)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    written, reference = {}, {}
    for name, tensor in tensors.items():
        if LINEAR.search(name):
            q, scale = quantize_channel(tensor)
            module = name[: -len(".weight")]
            written[name], written[module + ".weight_scale"] = q, scale
            reference[name] = q.float() * scale.float()
        else:
            written[name] = tensor.contiguous()
    if not reference:
        raise SystemExit(f"{src} has no model.layers.N.*_proj.weight tensors to quantize")
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "reference").mkdir(exist_ok=True)
    save_file(reference, str(out / "reference" / "dequant.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in COPIED:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return reference


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    src = Path(argv[0])
    if argv[0] == "default":
        from pagoda.modeling.default_model import resolve_model_path

        src = resolve_model_path(None)
    reference = convert(src, Path(argv[1]))
    print(f"wrote {argv[1]}: {len(reference)} int8 linears from {src}")


if __name__ == "__main__":
    main(sys.argv[1:])
