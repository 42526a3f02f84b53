"""Quantize a checkpoint with GPTQModel (GPTQ, v1 layout) and dump GPTQModel's own dequantization and tokens.

GPTQModel imports torchvision, so it lives in its own venv with a matching torch:

    python -m venv /work/qvenvs/gptq
    /work/qvenvs/gptq/bin/pip install torch==2.14.1 torchvision==0.29.1 gptqmodel
    GPTQMODEL_CPU_WORKERS=2 /work/qvenvs/gptq/bin/python contrib/quant-tools/quantize_gptqmodel.py SRC OUT \
        [--bits 4] [--group 32] [--no-desc-act] [--dtype bfloat16]
    ... quantize_gptqmodel.py --reference-only OUT

Writes OUT (safetensors + quantize_config.json; desc_act on unless --no-desc-act,
so g_idx is a real permutation), OUT/reference/dequant.safetensors (every linear as GPTQModel's
torch kernel dequantizes it, float32 ``[out, in]``) and
OUT/reference/generations.json (greedy tokens of GPTQModel's CPU runtime).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from reference_generations import write_reference_generations

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
PROSE = "/usr/share/common-licenses/GPL-3"


def calibration(tokenizer, vocab: int, num: int = 32, length: int = 64) -> list[dict]:
    """Random token ids for the tiny model; English prose (a licence text on the machine) for a real one."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (num, length), generator=gen)
    if vocab > 1000 and Path(PROSE).exists():
        ids = torch.tensor(tokenizer(Path(PROSE).read_text())["input_ids"][: num * length]).view(num, length)
    return [{"input_ids": row, "attention_mask": [1] * len(row)} for row in ids.tolist()]


def main(src: Path, out: Path, bits: int, group: int, desc_act: bool, dtype: torch.dtype) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src)
    config = QuantizeConfig(bits=bits, group_size=group, desc_act=desc_act, act_group_aware=False, sym=True)
    model = GPTQModel.load(str(src), config, device="cpu", dtype=dtype)
    model.quantize(calibration(tokenizer, model.config.vocab_size), batch_size=4)
    model.save(str(out))
    tokenizer.save_pretrained(out)
    del model
    dump_reference(out)


def dump_reference(out: Path) -> None:
    """GPTQModel's torch kernel unpacks every layer in float32 (exact: small ints times fp16 scales; in
    fp16 the products would round); a float32 transformers model with those weights gives the reference
    tokens."""
    from gptqmodel import BACKEND, GPTQModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    # the torch kernel loads in fp16/bf16 only; its fp16 scales widened to float32 make it unpack in float32
    quantized = GPTQModel.load(str(out), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    dense = {}
    for name, module in quantized.model.named_modules():
        if hasattr(module, "dequantize_weight") and hasattr(module, "qweight"):
            module.scales = module.scales.float()
            dense[name + ".weight"] = module.dequantize_weight().float().t().contiguous()  # [in, out] -> [out, in]
    del quantized
    (out / "reference").mkdir(exist_ok=True)
    save_file(dense, str(out / "reference" / "dequant.safetensors"))

    config_dir = out / "reference" / "dense-config"
    config_dir.mkdir(exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (config_dir / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    packed = load_file(str(out / "model.safetensors"))
    rest = {k: v for k, v in packed.items() if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    with torch.no_grad():
        for name, w in {**rest, **dense}.items():
            model.get_parameter(name).copy_(w)
    model.tie_weights()
    write_reference_generations(model, out, out)
    shutil.rmtree(config_dir)
    print("wrote", out)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--reference-only", action="store_true", help="redo the reference of checkpoint OUT")
    parser.add_argument("paths", nargs="+", help="SRC OUT, or OUT with --reference-only")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--no-desc-act", action="store_true", help="quantize columns in order (no g_idx permutation)")
    parser.add_argument("--dtype", default="bfloat16", help="model dtype while quantizing")
    args = parser.parse_args()
    if args.reference_only:
        dump_reference(Path(args.paths[-1]))
        sys.exit(0)
    main(Path(args.paths[0]), Path(args.paths[1]), args.bits, args.group, not args.no_desc_act,
         getattr(torch, args.dtype))
