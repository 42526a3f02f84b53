"""Quantize a checkpoint with AutoAWQ (GEMM, 4-bit) and dump AutoAWQ's own dequantization of it.

AutoAWQ 0.2.9 pins an older transformers, so it lives in its own venv:

    python -m venv /work/qvenvs/awq
    /work/qvenvs/awq/bin/pip install /opt/wheels/torch-*.whl autoawq==0.2.9 transformers==4.51.3
    /work/qvenvs/awq/bin/python contrib/quant-tools/quantize_awq.py SRC OUT [GROUP_SIZE [DTYPE]]
    ... quantize_awq.py --reference-only SRC OUT     # redo the reference of an existing checkpoint

GROUP_SIZE must divide every linear's in_features (64 for SmolLM2-135M, whose hidden size is 576).
DTYPE float32 is several times faster than the default float16 on a CPU without native fp16 matmuls
(SmolLM2-135M: about 50 s per layer with one thread).

On a CPU, AutoAWQ's scale search snapshots a block's weights with
``.cpu()``, which returns the very same tensors there, so the in-place
scaling of the search damages the snapshot and the checkpoint comes out
garbage. ``CloningAwqQuantizer`` takes real copies instead. AutoAWQ cannot
run its own checkpoint on a CPU (its CPU kernels need intel-extension-for-
pytorch), so the reference is AutoAWQ's ``dequantize_gemm`` unpacking each
layer into a dense float32 model, which transformers then runs:
OUT/reference/dequant.safetensors and OUT/reference/generations.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from reference_generations import write_reference_generations

PROSE = "/usr/share/common-licenses/GPL-3"


def cloning_quantizer():
    from awq.quantize.quantizer import AwqQuantizer

    class CloningAwqQuantizer(AwqQuantizer):
        def _compute_best_scale(self, x, w_mean, x_mean, module2inspect, linears2scale, fp16_output, kwargs={}):
            state_dict = module2inspect.state_dict
            # the search restores this snapshot after every trial; it must not alias the live weights
            module2inspect.state_dict = lambda *a, **k: {n: t.clone() for n, t in state_dict(*a, **k).items()}
            try:
                return super()._compute_best_scale(x, w_mean, x_mean, module2inspect, linears2scale, fp16_output,
                                                   kwargs)
            finally:
                del module2inspect.state_dict

    return CloningAwqQuantizer


def dump_reference(src: Path, out: Path, group_size: int) -> None:
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    packed = load_file(str(out / "model.safetensors"))
    dense = {}
    for name in packed:
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            # float32 scales: the products stay exact instead of rounding to fp16
            w = dequantize_gemm(packed[name], packed[base + ".qzeros"], packed[base + ".scales"].float(), 4,
                                group_size)
            dense[base + ".weight"] = w.t().float().contiguous()  # dequantize_gemm gives [in, out]
    (out / "reference").mkdir(exist_ok=True)
    save_file(dense, str(out / "reference" / "dequant.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    # AWQ folds its scales into the preceding norms, so those come from the checkpoint too
    rest = {k: v for k, v in packed.items() if not k.endswith((".qweight", ".qzeros", ".scales"))}
    with torch.no_grad():
        for name, w in {**rest, **dense}.items():
            if name != "lm_head.weight" or not model.config.tie_word_embeddings:
                model.get_parameter(name).copy_(w)
    write_reference_generations(model, out, out)


def compatible_source(src: Path) -> Path:
    """A view of ``src`` that transformers 4.51 reads: config written by transformers 5 keeps rope_theta
    under rope_parameters (4.51 would silently use 10000) and names a tokenizer class 4.51 lacks."""
    config = json.loads((src / "config.json").read_text())
    tok_config = json.loads((src / "tokenizer_config.json").read_text())
    if "rope_theta" in config and tok_config.get("tokenizer_class") != "TokenizersBackend":
        return src
    view = Path(tempfile.mkdtemp(prefix="awq-src-"))
    for item in src.iterdir():
        (view / item.name).symlink_to(item.resolve())
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for name, data in (("config.json", config), ("tokenizer_config.json", tok_config)):
        (view / name).unlink()
        (view / name).write_text(json.dumps(data))
    return view


def main(src: Path, out: Path, group_size: int, dtype: torch.dtype) -> None:
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    src = compatible_source(src)

    model = AutoAWQForCausalLM.from_pretrained(str(src), torch_dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(src)
    gen = torch.Generator().manual_seed(0)
    calib = torch.randint(3, model.config.vocab_size, (32, 64), generator=gen).tolist()
    if model.config.vocab_size > 1000 and Path(PROSE).exists():  # a real tokenizer: English prose
        calib = [p for p in Path(PROSE).read_text().split("\n\n") if len(p) > 200]
    quant_config = {"zero_point": True, "q_group_size": group_size, "w_bit": 4, "version": "GEMM"}
    model.quantize(tokenizer, quant_config=quant_config, calib_data=calib, max_calib_samples=32,
                   max_calib_seq_len=64, n_parallel_calib_samples=8, quantizer_cls=cloning_quantizer())
    model.save_quantized(str(out))
    tokenizer.save_pretrained(out)
    dump_reference(src, out, group_size)
    print("wrote", out)


if __name__ == "__main__":
    if sys.argv[1] == "--reference-only":
        ckpt = Path(sys.argv[3])
        config = json.loads((ckpt / "config.json").read_text())
        group = config.get("quantization_config", {}).get("group_size") or json.loads(
            (ckpt / "quant_config.json").read_text())["q_group_size"]
        dump_reference(compatible_source(Path(sys.argv[2])), ckpt, group)
        sys.exit(0)
    # float32 searches several times faster than float16 on a CPU without native fp16 matmuls
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 64,
         getattr(torch, sys.argv[4]) if len(sys.argv) > 4 else torch.float16)
