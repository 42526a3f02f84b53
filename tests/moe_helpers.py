"""What the packed-experts kernel tests share: a random routing, and the tolerance of a result against the
float32 reference."""

from __future__ import annotations

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
