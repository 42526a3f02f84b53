"""Quantize a checkpoint with GPTQModel (GPTQ, v1 layout) and dump GPTQModel's own dequantization and tokens.

GPTQModel imports torchvision, so it lives in its own venv with a matching torch:

    python -m venv /work/qvenvs/gptq
    /work/qvenvs/gptq/bin/pip install torch==2.14.1 torchvision==0.29.1 gptqmodel
    GPTQMODEL_CPU_WORKERS=2 /work/qvenvs/gptq/bin/python contrib/quant-tools/quantize_gptqmodel.py SRC OUT [BITS GROUP]
    ... quantize_gptqmodel.py --reference-only OUT

Writes OUT (safetensors + quantize_config.json, desc_act on so g_idx is a real
permutation), OUT/reference/dequant.safetensors (every linear as GPTQModel's
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

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")


def prompts_for(tokenizer, vocab_size: int) -> list[list[int]]:
    if vocab_size > 1000:  # a real tokenizer: real text
        texts = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
        return [tokenizer(t)["input_ids"] for t in texts]
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (5, 11, 23)]


def main(src: Path, out: Path, bits: int, group: int) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src)
    config = QuantizeConfig(bits=bits, group_size=group, desc_act=True, act_group_aware=False, sym=True)
    model = GPTQModel.load(str(src), config, device="cpu")
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    calib = [{"input_ids": ids, "attention_mask": [1] * len(ids)}
             for ids in torch.randint(3, vocab, (32, 64), generator=gen).tolist()]
    model.quantize(calib, batch_size=4)
    model.save(str(out))
    tokenizer.save_pretrained(out)
    del model
    dump_reference(out)


def dump_reference(out: Path) -> None:
    """GPTQModel's torch kernel unpacks every layer (fp16: exact for 4-bit codes times fp16 scales); a
    float32 transformers model with those weights gives the reference tokens."""
    from gptqmodel import BACKEND, GPTQModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    quantized = GPTQModel.load(str(out), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    dense = {}
    for name, module in quantized.model.named_modules():
        if hasattr(module, "dequantize_weight") and hasattr(module, "qweight"):
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
    prompts, outputs = prompts_for(tokenizer, model.config.vocab_size), []
    for ids in prompts:
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        outputs.append(seq[0, len(ids):].tolist())
    (out / "reference" / "generations.json").write_text(json.dumps({"prompts": prompts, "outputs": outputs}))
    shutil.rmtree(config_dir)
    print("wrote", out)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[0] == "--reference-only":  # redo the reference of an existing checkpoint
        dump_reference(Path(args[1]))
        sys.exit(0)
    main(Path(args[0]), Path(args[1]), int(args[2]) if len(args) > 2 else 4, int(args[3]) if len(args) > 3 else 32)
