"""Quantize a checkpoint with llm-compressor into compressed-tensors formats, and dump its own dequantization.

Run in a venv of its own (llm-compressor pins its transformers):

    python -m venv /work/qvenvs/llmc
    /work/qvenvs/llmc/bin/pip install /opt/wheels/torch-*.whl llmcompressor
    /work/qvenvs/llmc/bin/python contrib/quant-tools/quantize_llmcompressor.py SRC OUT_ROOT [schemes...]
    ... quantize_llmcompressor.py --reference-only CKPT [CKPT ...]

Schemes: w4a16-gptq (GPTQ, group 64, actorder weight: compressed-tensors 0.19 removed "group"), w8a16 (RTN, channel),
fp8-dynamic (FP8 channel weights, dynamic per-token activations),
fp8-w8a16 (FP8 channel weights only),
fp8-static (FP8 tensor weights and activations, calibrated). Each lands in
OUT_ROOT/<scheme>/ with ``reference/dequant.safetensors`` (a subfolder, so loaders skip it): every quantized
linear's weight as compressed-tensors itself decompresses it, in float32, and
``reference/generations.json``: greedy tokens of transformers running it.
Calibration uses random token ids (the checkpoints are for format tests).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from reference_generations import write_reference_generations

PROSE = "/usr/share/common-licenses/GPL-3"


def recipe_for(scheme: str):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if scheme == "w4a16-gptq":
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64,
                                   actorder="weight")
        return GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                            ignore=["lm_head"], dampening_frac=0.1)
    if scheme == "w8a16":
        return QuantizationModifier(targets="Linear", scheme="W8A16", ignore=["lm_head"])
    if scheme == "fp8-dynamic":
        return QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])
    if scheme == "fp8-w8a16":  # FP8 channel weights, activations left in full precision
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        return QuantizationModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                                    ignore=["lm_head"])
    if scheme == "fp8-static":
        return QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"])
    raise SystemExit(f"unknown scheme {scheme}")


def calibration(vocab: int, tokenizer, num: int = 16, length: int = 64):
    """Random token ids for the tiny model; English prose (a licence text on the machine) for a real one."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (num, length), generator=gen)
    if vocab > 1000 and Path(PROSE).exists():
        tokens = tokenizer(Path(PROSE).read_text())["input_ids"][: num * length]
        ids = torch.tensor(tokens).view(num, length)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})


def dump_reference(out: Path) -> None:
    """Load the saved checkpoint back through compressed-tensors' decompression; save dense linears."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    # run_compressed=False: compressed-tensors decompresses every layer into a dense weight
    model = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False))
    dense = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            dense[name + ".weight"] = module.weight.detach().float().contiguous()
    (out / "reference").mkdir(exist_ok=True)
    save_file(dense, str(out / "reference" / "dequant.safetensors"))
    write_reference_generations(model, out, out)


def main(src: Path, out_root: Path, schemes: list[str]) -> None:
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for scheme in schemes:
        out = out_root / scheme
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float16)
        tokenizer = AutoTokenizer.from_pretrained(src)
        oneshot(model=model, dataset=calibration(model.config.vocab_size, tokenizer), recipe=recipe_for(scheme),
                max_seq_length=64, num_calibration_samples=16)
        model.save_pretrained(out, save_compressed=True)
        tokenizer.save_pretrained(out)
        dump_reference(out)
        print("wrote", out)


if __name__ == "__main__":
    if sys.argv[1] == "--reference-only":  # redo the reference of existing checkpoints
        for ckpt in sys.argv[2:]:
            dump_reference(Path(ckpt))
        sys.exit(0)
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:] or ["w4a16-gptq", "w8a16", "fp8-dynamic", "fp8-static"])
