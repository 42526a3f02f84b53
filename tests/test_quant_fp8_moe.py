"""FP8 routed experts kept one byte a weight (plugins/quant/fp8_moe.py): the int kernel's MoE call on e4m3 codes
(this CPU's path, the AVX2 build, the scalar loops) and the torch path compute what the experts decoded to float32
compute, in float32 and bfloat16, scales per row or per block, subnormal codes, 1 to 19 tokens, top-3 of 5; the
scales stay float32 in a bf16 model; a compressed-tensors FP8 Qwen3-MoE and a ``quant_method: fp8`` one with block
scales (``weight_scale_inv``) that transformers writes give transformers' greedy tokens, and first-step
log-probabilities within 2e-3, on their decoded weights, experts packed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from pagoda import LLM, SamplingParams
from pagoda.errors import CheckpointError
from pagoda.host.env import resolve_host_config
from pagoda.modeling.default_model import ensure_default_model
from pagoda.modeling.layers.moe import FusedMoE
from pagoda.plugins.quant import cpu_int_kernel
from pagoda.plugins.quant.cpu_int_kernel import TILE_ROWS
from pagoda.plugins.quant.fp8 import fake_quantize_activations
from pagoda.plugins.quant.fp8_moe import Fp8MoeMethod
from moe_helpers import check_experts_output, check_kernel_paths, decoded_reference, random_routing

NUM_EXPERTS, TOP_K = 5, 3
TOKENS = (1, 4, 19)
FP8 = torch.float8_e4m3fn


def to_fp8(w: torch.Tensor, block: tuple[int, int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` as float8_e4m3fn with float32 scales, one per row (``block`` None) or per block."""
    if block is None:
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448  # [out, 1]
        return (w / scale).to(FP8), scale
    rows, cols = block
    blocks = (-(-w.shape[0] // rows), -(-w.shape[1] // cols))
    padded = torch.nn.functional.pad(w, (0, blocks[1] * cols - w.shape[1], 0, blocks[0] * rows - w.shape[0]))
    scale = padded.view(blocks[0], rows, blocks[1], cols).abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
    full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: w.shape[0], : w.shape[1]]
    return (w / full).to(FP8), scale


def decoded(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """What the packed experts compute with: the fp8 values times their float32 scales."""
    if block is not None:
        scale = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: q.shape[0], : q.shape[1]]
    return q.float() * scale


def _experts(dtype, hidden, inter, block=None, kernel="cpu", seed=0, subnormal=False):
    """(packed FusedMoE, the same experts decoded to float32 in a torch-only FusedMoE); ``subnormal``: every code
    one of e4m3's subnormals (exponent field 0), the ones a decoding may lose."""
    gen = torch.Generator().manual_seed(seed)
    method = Fp8MoeMethod(-1 if block is None else block[1], 1 if block is None else block[0], kernel,
                          resolve_host_config(), "compressed-tensors FP8")
    packed = FusedMoE(NUM_EXPERTS, hidden, inter, dtype, host=resolve_host_config(), prefix="l.experts",
                      quant_method=method)
    reference = FusedMoE(NUM_EXPERTS, hidden, inter, torch.float32, host=None, prefix="l.experts")
    for e in range(NUM_EXPERTS):
        for part, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            w = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen)  # rows of unlike scales
            q, scale = to_fp8(w, block)
            if subnormal:
                q = (torch.randint(0, 256, shape, generator=gen) & 0x87).to(torch.uint8).view(FP8)
            name = f"l.experts.{e}.{part}_proj"
            packed.load_quantized(part, e, {"weight": q, "weight_scale": scale}, name)
            reference.load_expert(part, e, decoded(q, scale, block), name)
    assert not packed.missing() and packed.w13 is None
    return packed, reference


def _run_kernel(kernels, layer, x, weights, ids, impl):
    method = layer.quant_method
    return kernels.int_moe_experts(x, layer.w13_q, layer.w13_scales, None, layer.w2_q, layer.w2_scales, None, None,
                                   None, None, None, ids, weights, 8, 2, method.group_of(layer.hidden_size),
                                   method.group_of(layer.intermediate_size), 0, 1.702, 7.0, impl,
                                   cpu_int_kernel.default_gemm_min_rows(kernels), TILE_ROWS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hidden, inter, block, subnormal", [
    (37, 23, None, False),  # odd sizes, a scale per row
    (96, 48, (16, 32), False),  # scales per block of 16 rows x 32 columns, the down projection's last block half full
    (37, 23, None, True),
])
def test_packed_fp8_experts_compute_what_their_decoded_weights_compute(dtype, hidden, inter, block, subnormal):
    packed, reference = _experts(dtype, hidden, inter, block, subnormal=subnormal)
    # 19 tokens: about 11 per expert, the dequantized-tile GEMM
    check_kernel_paths(packed, reference, _run_kernel, hidden, dtype, TOKENS, NUM_EXPERTS, TOP_K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_torch_path_decodes_the_chosen_fp8_experts_and_computes_the_same(dtype):
    packed, reference = _experts(dtype, 96, 48, (16, 32), kernel="torch", seed=1)
    assert packed.isa_path() == "FP8 experts, dequantized per call (torch)"
    for seed, tokens in enumerate(TOKENS):
        x, weights, ids = random_routing(tokens, 96, seed, NUM_EXPERTS, TOP_K)
        check_experts_output(packed(x.to(dtype), weights, ids), reference(x.to(dtype).float(), weights, ids), dtype)


def test_fp8_experts_keep_float32_scales_in_a_bf16_model():
    """A bf16 scale keeps 8 of a float32 scale's 24 bits: rounded so, the scales alone put the experts' output
    about 4e-3 (relative) off their decoded weights' in float32; the float32 scales held, 1e-6."""
    packed, reference = _experts(torch.bfloat16, 96, 48, (16, 32), seed=2)
    assert packed.w13_scales.dtype == packed.w2_scales.dtype == torch.float32
    as_float32 = FusedMoE(NUM_EXPERTS, 96, 48, torch.float32, host=resolve_host_config(), prefix="l.experts",
                          quant_method=packed.quant_method)
    for name, param in packed.named_parameters():
        getattr(as_float32, name).data.copy_(param.data)
    x, weights, ids = random_routing(19, 96, 0, NUM_EXPERTS, TOP_K)
    want = reference(x, weights, ids)

    def error():
        with torch.inference_mode():
            return float((as_float32(x, weights, ids) - want).abs().max() / want.abs().max())

    assert error() < 1e-5
    for name in ("w13_scales", "w2_scales"):
        getattr(as_float32, name).data.copy_(getattr(as_float32, name).data.bfloat16().float())
    assert error() > 1e-3


def test_fp8_experts_take_a_byte_per_weight_and_refuse_scales_that_do_not_fit():
    packed, _ = _experts(torch.bfloat16, 64, 32)
    assert packed.expert_bytes() == 3 * 64 * 32 + 4 * (2 * 32 + 64)  # a float32 scale per row
    q = torch.zeros(32, 64, dtype=FP8)
    with pytest.raises(CheckpointError, match=r"weight_scale \(3,\) is neither one scale nor one per output row"):
        packed.load_quantized("up", 1, {"weight": q, "weight_scale": torch.ones(3)}, "l.experts.1.up_proj")
    with pytest.raises(CheckpointError, match="weight is torch.float32; compressed-tensors FP8 expects float8_e4m3fn"):
        packed.load_quantized("up", 1, {"weight": q.float(), "weight_scale": torch.ones(32)}, "l.experts.1.up_proj")


def _fp8_qwen3_moe(tmp_path, seed: int, quantized: tuple[str, ...], block, scale_name: str,
                   quantization_config: dict):
    """A tiny Qwen3-MoE that transformers writes, the projections whose names hold one of ``quantized`` turned to
    FP8 (a scale per row, per ``block``, or with ``block`` "tensor" one per module, stored as ``scale_name``): (its
    folder, transformers on its decoded weights)."""
    default_dir = ensure_default_model()
    vocab_size = len(json.loads((default_dir / "tokenizer.json").read_text())["model"]["vocab"])
    # intermediate_size: the dense MLP a sparse layer is built with before its experts replace it, in whole blocks
    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=64, moe_intermediate_size=40,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                            initializer_range=0.2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    src, out = tmp_path / "dense", tmp_path / "fp8"
    model.save_pretrained(str(src), safe_serialization=True)
    tensors, dequant = load_file(str(src / "model.safetensors")), {}
    for name in [n for n in tensors if any(p in n for p in quantized) and n.endswith("_proj.weight")]:
        if block == "tensor":  # one block covering the whole tensor, its scale stored as a scalar
            q, scale = to_fp8(tensors[name], tuple(tensors[name].shape))
            scale, dequant[name] = scale.reshape(()), q.float() * scale
        else:
            q, scale = to_fp8(tensors[name], block)
            dequant[name] = decoded(q, scale, block)
        tensors[name], tensors[name.replace(".weight", f".{scale_name}")] = q, scale
    assert sum(".mlp.experts." in name for name in dequant) == 2 * 4 * 3  # every routed expert's projections
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, out / name)
    return out, decoded_reference(src, dequant, tmp_path / "decoded")


def _check_greedy(llm, reference) -> None:
    """pagoda's greedy tokens are the reference's, and its first-step log-probabilities within 2e-3."""
    prompts = [[5, 17, 923, 4001, 77], list(range(100, 340, 7))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, got in zip(prompts, outputs):
        with torch.inference_mode():
            ref = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, pad_token_id=0,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     output_logits=True, return_dict_in_generate=True)
        assert got.outputs[0].token_ids == ref.sequences[0, len(prompt):].tolist(), f"a prompt of {len(prompt)}"
        ref_first = torch.log_softmax(ref.logits[0][0].float(), dim=-1)
        for tid, lp in got.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - float(ref_first[tid])) < 2e-3, tid


def test_a_compressed_tensors_fp8_qwen3_moe_gives_the_tokens_of_its_decoded_experts(tmp_path):
    out, reference = _fp8_qwen3_moe(tmp_path, 5, (".mlp.experts.",), None, "weight_scale", {
        "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
            "group_0": {"targets": ["re:.*mlp\\.experts\\..*"], "weights": {
                "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}}})
    llm = LLM(model=str(out), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, cpu_threads=1)
    try:
        experts = llm.engine.runner.model.experts_of(0)
        assert experts.w13 is None and experts.w13_q.dtype == torch.uint8 and "FP8 packed experts" in experts.isa_path()
        _check_greedy(llm, reference)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("attention, block", [("bf16", (32, 32)), ("fp8", (32, 32)), ("fp8", "tensor")])
def test_an_fp8_qwen3_moe_checkpoint_gives_the_tokens_of_its_decoded_weights(tmp_path, attention, block):
    """``quant_method: fp8`` as Qwen3-30B-A3B-FP8 is published: every expert's projections (and the attention's,
    unless ``modules_to_not_convert`` names them) float8_e4m3fn with a ``weight_scale_inv`` per block of
    ``weight_block_size``, dynamic activations, the router and the LM head left unquantized; or without
    ``weight_block_size``, one ``weight_scale`` per module. The experts stay one byte a weight (partial blocks: 40
    rows and columns in blocks of 32); the attention layers, when quantized, take their inputs through FP8 per token
    as the format says, and so does the reference (transformers on the decoded weights, the same rounding hooked in
    front of its attention projections)."""
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    if block != "tensor":
        config["weight_block_size"] = list(block)
    if attention == "bf16":
        config["modules_to_not_convert"] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    quantized = (".mlp.experts.", ".self_attn.") if attention == "fp8" else (".mlp.experts.",)
    scale_name = "weight_scale" if block == "tensor" else "weight_scale_inv"
    out, reference = _fp8_qwen3_moe(tmp_path, 6, quantized, block, scale_name, config)
    if attention == "fp8":  # dynamic activations: each token's input rounded through FP8 with its own scale
        for name, module in reference.named_modules():
            if ".self_attn." in name and name.endswith("_proj"):
                module.register_forward_pre_hook(lambda _, args: (fake_quantize_activations(args[0], None),))
    llm = LLM(model=str(out), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, cpu_threads=1)
    try:
        pagoda_model = llm.engine.runner.model
        experts = pagoda_model.experts_of(1)
        assert experts.w13 is None and experts.w13_q.dtype == torch.uint8 and "FP8 packed experts" in experts.isa_path()
        assert experts.w13_scales.dtype == torch.float32
        assert experts.quant_method.group_of(64) == (64 if block == "tensor" else block[1])
        attn_method = type(pagoda_model.layers[0].qkv_proj.quant_method).__name__
        assert attn_method == ("Fp8LinearMethod" if attention == "fp8" else "UnquantizedLinearMethod")
        _check_greedy(llm, reference)
    finally:
        llm.engine.shutdown()
