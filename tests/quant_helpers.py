"""Quantized checkpoints for the quant tests, packed here from the published formats.

The packers below follow the formats' documentation (AutoAWQ GEMM, GPTQ v1/v2,
compressed-tensors pack-quantized, FP8) and share no code with
``pagoda.plugins.quant``, so a misreading on either side shows up as a
mismatch. Each builder writes a checkpoint directory next to the tiny random
Llama in tests/data/quant/tiny-llama and returns the dequantized weight of
every checkpoint linear (float32, ``[out, in]``), the reference the tests
compare pagoda against.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

DATA = Path(__file__).parent / "data" / "quant"
TINY = DATA / "tiny-llama"
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FUSED = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "down_proj": ("mlp.down_proj",)}
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column AWQ_PACK_ORDER[i] of its group of 8
FP8 = torch.float8_e4m3fn


def tiny_linears() -> dict[str, torch.Tensor]:
    """Checkpoint module name -> float32 weight ``[out, in]`` of the tiny model."""
    tensors = load_file(str(TINY / "model.safetensors"))
    return {k[: -len(".weight")]: v.float() for k, v in tensors.items()
            if any(k.endswith(m + ".weight") for m in LINEARS)}


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], quant_config: Optional[dict],
                     quant_file: Optional[str] = None) -> Path:
    """Tiny model's other tensors + ``tensors``; the quant config in config.json or in ``quant_file``."""
    out.mkdir(parents=True, exist_ok=True)
    base = load_file(str(TINY / "model.safetensors"))
    kept = {k: v for k, v in base.items() if not any(k.endswith(m + ".weight") for m in LINEARS)}
    save_file({**kept, **tensors}, str(out / "model.safetensors"))
    config = json.loads((TINY / "config.json").read_text())
    if quant_config is not None and quant_file is None:
        config["quantization_config"] = quant_config
    elif quant_config is not None:
        (out / quant_file).write_text(json.dumps(quant_config))
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY / name, out / name)
    return out


def write_dense(out: Path, weights: dict[str, torch.Tensor], base: Optional[Path] = None) -> Path:
    """A dense float32 checkpoint with ``weights`` as its linears (the full-precision reference)."""
    out.mkdir(parents=True, exist_ok=True)
    source = base or TINY
    tensors = {k: v.float() for k, v in load_file(str(source / "model.safetensors")).items()
               if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx", ".weight_packed", ".weight_scale",
                                  ".weight_shape", ".weight_g_idx", ".input_scale", ".weight_scale_inv"))
               and not any(k.endswith(m + ".weight") for m in LINEARS)}
    tensors.update({k + ".weight": v.float().contiguous() for k, v in weights.items()})
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((TINY / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY / name, out / name)
    return out


# ---- group-wise integer quantization (the math every int format shares) ----

def group_of_columns(in_features: int, group: int, perm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``g_idx``: group of each input column; under act-order, column ``perm[j]`` is in group ``j // group``."""
    g_idx = torch.arange(in_features) // group
    if perm is not None:
        g_idx = torch.empty_like(g_idx).scatter_(0, perm, torch.arange(in_features) // group)
    return g_idx


def quantize_groups(w: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool,
                    scale_dtype: torch.dtype = torch.float16):
    """``w [out, in]`` -> (q ``[out, in]`` in [0, 2**bits), scales ``[out, G]``, zeros ``[out, G]`` ints)."""
    num_groups = int(g_idx.max()) + 1
    maxq = (1 << bits) - 1
    scales = torch.empty(w.shape[0], num_groups)
    zeros = torch.empty(w.shape[0], num_groups, dtype=torch.int64)
    for g in range(num_groups):
        cols = w[:, g_idx == g]
        if sym:
            scales[:, g] = cols.abs().amax(1).clamp(min=1e-6) * 2 / maxq
            zeros[:, g] = (maxq + 1) // 2
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scales[:, g] = ((hi - lo) / maxq).clamp(min=1e-6)
            zeros[:, g] = torch.round(-lo / scales[:, g].to(scale_dtype).float()).clamp(0, maxq).long()
    scales = scales.to(scale_dtype)
    s_col, z_col = scales.float()[:, g_idx], zeros[:, g_idx]
    q = torch.clamp(torch.round(w / s_col) + z_col, 0, maxq).long()
    return q, scales, zeros


def dequantize_groups(q, scales, zeros, g_idx) -> torch.Tensor:
    return (q.float() - zeros[:, g_idx].float()) * scales.float()[:, g_idx]


# ---- bit packing, written from the formats' descriptions ----

def pack_along_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[n, m] -> [n * bits / 32, m]`` int32: row ``r * (32 / bits) + j`` at bit ``j * bits`` of word row ``r``."""
    per_word = 32 // bits
    words = torch.zeros(values.shape[0] // per_word, values.shape[1], dtype=torch.int64)
    for j in range(per_word):
        words |= (values[j::per_word].long() & ((1 << bits) - 1)) << (j * bits)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # reinterpret as signed 32-bit


def pack_along_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_along_rows(values.t(), bits).t().contiguous()


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """``[n, m] -> [n, m / 8]``: nibble ``i`` of word ``c`` holds column ``8 c + AWQ_PACK_ORDER[i]``."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_PACK_ORDER):
        words |= values[:, col::8].long() << (4 * i)
    return (words - ((words >> 31) << 32)).to(torch.int32)


# ---- checkpoint builders ----

def awq_checkpoint(out: Path, group: int = 32, quant_file: Optional[str] = None) -> dict[str, torch.Tensor]:
    tensors, ref = {}, {}
    for name, w in tiny_linears().items():
        g_idx = group_of_columns(w.shape[1], group)
        q, scales, zeros = quantize_groups(w, 4, g_idx, sym=False)
        tensors[name + ".qweight"] = pack_awq(q.t())  # [in, out / 8]
        tensors[name + ".qzeros"] = pack_awq(zeros.t())  # [in / group, out / 8]
        tensors[name + ".scales"] = scales.t().contiguous()  # [in / group, out] fp16
        ref[name] = dequantize_groups(q, scales, zeros, g_idx)
    cfg = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    if quant_file:  # AutoAWQ's own quant_config.json spelling
        cfg = {"quant_method": "awq", "w_bit": 4, "q_group_size": group, "zero_point": True, "version": "GEMM"}
    write_checkpoint(out, tensors, cfg, quant_file)
    return ref


def gptq_checkpoint(out: Path, bits: int = 4, group: int = 32, desc_act: bool = False, sym: bool = True,
                    checkpoint_format: str = "gptq", seed: int = 0, shared_perm: bool = True
                    ) -> dict[str, torch.Tensor]:
    """GPTQ layout; under ``desc_act`` each input is permuted (shared by modules reading the same input)."""
    gen = torch.Generator().manual_seed(seed)
    tensors, ref, perms = {}, {}, {}
    for name, w in tiny_linears().items():
        in_features = w.shape[1]
        group_size = in_features if group == -1 else group
        perm = None
        if desc_act:
            key = (name.rsplit(".", 1)[0], in_features) if shared_perm else name
            perm = perms.setdefault(key, torch.randperm(in_features, generator=gen))
        g_idx = group_of_columns(in_features, group_size, perm)
        q, scales, zeros = quantize_groups(w, bits, g_idx, sym=sym)
        stored_zeros = zeros - (1 if checkpoint_format == "gptq" else 0)  # v1 keeps zero - 1
        tensors[name + ".qweight"] = pack_along_rows(q.t(), bits)  # [in * bits / 32, out]
        tensors[name + ".qzeros"] = pack_along_cols(stored_zeros.t(), bits)  # [G, out * bits / 32]
        tensors[name + ".scales"] = scales.t().contiguous()  # [G, out]
        tensors[name + ".g_idx"] = g_idx.to(torch.int32)
        ref[name] = dequantize_groups(q, scales, zeros, g_idx)
    cfg = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
           "checkpoint_format": checkpoint_format}
    write_checkpoint(out, tensors, cfg, "quantize_config.json")
    return ref


def compressed_int_checkpoint(out: Path, bits: int = 4, group: Optional[int] = 32, actorder: Optional[str] = None,
                              seed: int = 0) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized (symmetric); ``group=None`` is the channel strategy."""
    gen = torch.Generator().manual_seed(seed)
    tensors, ref, perms = {}, {}, {}
    offset = 1 << (bits - 1)
    for name, w in tiny_linears().items():
        in_features = w.shape[1]
        perm = None
        if actorder == "group":
            perm = perms.setdefault((name.rsplit(".", 1)[0], in_features), torch.randperm(in_features, generator=gen))
        g_idx = group_of_columns(in_features, group or in_features, perm)
        q, scales, zeros = quantize_groups(w, bits, g_idx, sym=True, scale_dtype=torch.bfloat16)
        signed = q - offset  # symmetric ints in [-2**(b-1), 2**(b-1))
        tensors[name + ".weight_packed"] = pack_along_cols(signed + offset, bits)  # [out, in * bits / 32]
        tensors[name + ".weight_scale"] = scales  # [out, G] (G = 1 for channel)
        tensors[name + ".weight_shape"] = torch.tensor(list(w.shape))
        if actorder == "group":
            tensors[name + ".weight_g_idx"] = g_idx.to(torch.int32)
        ref[name] = signed.float()[:, :] * scales.float()[:, g_idx]
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group" if group else "channel",
               "group_size": group, "actorder": actorder, "dynamic": False}
    cfg = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}}}
    write_checkpoint(out, tensors, cfg)
    return ref


def fp8_checkpoint(out: Path, activation_scheme: str = "dynamic", block: Optional[tuple[int, int]] = None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """vLLM-style ``quant_method: fp8``: per-tensor ``weight_scale`` or block ``weight_scale_inv``.

    Returns the dequantized weights and, for static activations, each module's input scale.
    """
    tensors, ref, input_scales = {}, {}, {}
    for name, w in tiny_linears().items():
        if block is None:
            scale = w.abs().max() / 448.0
            wq = (w / scale).to(FP8)
            tensors[name + ".weight_scale"] = scale.reshape(())
            ref[name] = wq.float() * scale
        else:
            bo, bi = block
            blocks = w.view(w.shape[0] // bo, bo, w.shape[1] // bi, bi)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [out / bo, in / bi]
            wq = (blocks / scale[:, None, :, None]).to(FP8)
            tensors[name + ".weight_scale_inv"] = scale
            ref[name] = (wq.float() * scale[:, None, :, None]).view_as(w)
            wq = wq.view_as(w)
        tensors[name + ".weight"] = wq
        if activation_scheme == "static":
            input_scales[name] = 0.02 if "down_proj" in name else 0.01
            tensors[name + ".input_scale"] = torch.tensor(input_scales[name])
    cfg = {"quant_method": "fp8", "activation_scheme": activation_scheme}
    if block is not None:
        cfg["weight_block_size"] = list(block)
    write_checkpoint(out, tensors, cfg)
    return ref, input_scales


def fake_quant_fp8(x: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """Activations through fp8 and back: per-token scale when ``scale`` is None."""
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0 if scale is None else torch.tensor(scale)
    return (x / s).clamp(-448, 448).to(FP8).float() * s


def fused_reference(ref: dict[str, torch.Tensor], layer: int, fused: str) -> torch.Tensor:
    """The dequantized weight of pagoda's fused layer ``fused`` in ``layer`` (shards stacked on dim 0)."""
    return torch.cat([ref[f"model.layers.{layer}.{m}"] for m in FUSED[fused]])


def assert_linears_match(model, ref: dict[str, torch.Tensor], rows: int = 5, rtol: float = 1e-5,
                         atol: float = 1e-5) -> None:
    """Every fused linear of every layer of ``model`` gives ``x @ W^T`` for its dequantized reference ``W``."""
    x = torch.randn(rows, 256)
    for i, layer in enumerate(model.layers):
        for fused in FUSED:
            linear = getattr(layer, fused)
            xin = x[:, : linear.in_features]
            torch.testing.assert_close(linear(xin), xin @ fused_reference(ref, i, fused).t(), rtol=rtol, atol=atol)


def small_llm(path: Optional[Path] = None, **kwargs):
    """An engine with a small KV cache and no swap space (the defaults reserve gigabytes, slow to zero), on one
    compute thread (an engine told no thread count times matmuls on one and on every core first: 18 s for each
    engine measured on a loaded 2-core machine)."""
    from pagoda import LLM

    kwargs.setdefault("kv_cache_memory_bytes", 32 << 20)
    kwargs.setdefault("swap_space", 0)
    kwargs.setdefault("cpu_threads", 1)
    return LLM(None if path is None else str(path), **kwargs)


def greedy(path: Path, prompts: list[list[int]], num_tokens: int = 16, **kwargs) -> list[list[int]]:
    from pagoda import SamplingParams

    llm = small_llm(path, dtype=kwargs.pop("dtype", "float32"), **kwargs)
    params = SamplingParams(max_tokens=num_tokens, min_tokens=num_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


PROMPTS = [[1, 5, 9, 100, 200], [1, 300, 17, 44, 45, 46, 250, 12, 90, 91, 300], list(range(3, 60, 3))]


def edit_checkpoint(path: Path, edit=None, config_edit=None, config_file: str = "config.json") -> Path:
    """Damage a written checkpoint: ``edit(tensors)`` in place, ``config_edit(quant_config)`` in place.

    The quantization config is ``quantization_config`` inside config.json, or a
    whole side file such as GPTQ's quantize_config.json.
    """
    if edit:
        tensors = load_file(str(path / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(path / "model.safetensors"))
    if config_edit:
        cfg = json.loads((path / config_file).read_text())
        config_edit(cfg["quantization_config"] if config_file == "config.json" else cfg)
        (path / config_file).write_text(json.dumps(cfg))
    return path
