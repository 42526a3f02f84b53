"""What the packed-experts tests share: a random routing, random expert biases, the tolerance of a result against
the float32 reference, the kernel's paths checked against it, and transformers on decoded weights."""

from __future__ import annotations

import shutil

import torch


def random_routing(tokens: int, hidden: int, seed: int, num_experts: int,
                   top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x ``[tokens, hidden]`` float32, weights ``[tokens, top_k]``, distinct expert ids ``[tokens, top_k]``)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    return x, torch.rand(tokens, top_k, generator=gen), ids


def check_experts_output(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: to 1e-5; bf16: activations, gate_up sums, h and y rounded to bf16 as a bf16 MLP rounds them."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    else:
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-2 * float(want.abs().max()))


def load_bias(layers, part: str, expert: int, rows: int, dtype: torch.dtype, gen: torch.Generator,
              name: str, std: float = 1.0) -> None:
    """One random ``{part}_bias`` of ``rows`` values, exact in ``dtype``, into expert ``expert`` of each of ``layers``
    (FusedMoE layers built with biases)."""
    bias = (torch.randn(rows, generator=gen) * std).to(dtype).float()
    for layer in layers:
        layer.load_expert(f"{part}_bias", expert, bias, name)


def check_kernel_paths(packed, reference, run_kernel, hidden: int, dtype: torch.dtype, tokens, num_experts: int,
                       top_k: int) -> None:
    """The packed experts (this CPU's kernel path), the kernel's scalar loops and its AVX2 build, each called as
    ``run_kernel(kernels, packed, x, weights, ids, impl)``, against ``reference`` (the experts decoded to float32 in
    a torch-only FusedMoE), for each count of ``tokens``."""
    from isa_builds import build_at

    from pagoda.plugins.quant import cpu_int_kernel
    from pagoda.plugins.quant.cpu_int_kernel import IMPL_AUTO, IMPL_SCALAR

    kernels = packed.int_kernels
    assert kernels is not None, "the int kernel builds on this machine"
    avx2 = build_at("avx2", "pagoda_cpu_int_linear", cpu_int_kernel._SOURCE)
    paths = [("auto", lambda x, w, i: packed(x, w, i)),
             ("scalar", lambda x, w, i: run_kernel(kernels, packed, x, w, i, IMPL_SCALAR)),
             ("avx2", lambda x, w, i: run_kernel(avx2, packed, x, w, i, IMPL_AUTO))]
    for seed, count in enumerate(tokens):
        x, weights, ids = random_routing(count, hidden, seed, num_experts, top_k)
        xd = x.to(dtype)
        want = reference(xd.float(), weights, ids)
        for path, run in paths:
            with torch.inference_mode():  # as the engine runs it: the kernel's threads take the mode too
                got = run(xd, weights, ids)
            assert got.dtype == dtype and got.shape == (count, hidden), path
            check_experts_output(got, want, dtype)


def decoded_reference(src, dequant: dict, out):
    """transformers on the checkpoint folder ``src`` with the tensors ``dequant`` (name -> float32 weight) in place of
    its own, written to the folder ``out``, greedy without an end-of-sequence token."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    out.mkdir()
    shutil.copy(src / "config.json", out / "config.json")
    save_file({**load_file(str(src / "model.safetensors")), **dequant}, str(out / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    return model
