"""The ``triton`` LoRA backend's kernels, run by Triton's interpreter on the CPU (conftest.py sets
TRITON_INTERPRET=1 where there is no GPU): the backend contract, and odd shapes against an exact reference."""

from __future__ import annotations

import pytest
import torch

from pagoda.config import LoRAConfig
from pagoda.errors import BackendUnavailable
from pagoda.execution.lora_triton import TritonLoRABackend, interpreting
from pagoda.step import LoRABatch
from pagoda.testing import check_lora_backend

pytestmark = pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(),
                                reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")
CONFIG = LoRAConfig(max_loras=3, max_lora_rank=8, max_cpu_loras=3)


def test_the_triton_backend_meets_the_lora_backend_contract():
    check_lora_backend(TritonLoRABackend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens,in_features,out_features,rank", [(1, 37, 23, 1), (5, 100, 50, 24), (9, 130, 17, 64)])
def test_each_adapter_token_gets_its_slots_term_and_base_tokens_none(dtype, tokens, in_features, out_features, rank):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    y = torch.randn(tokens, out_features, generator=gen).to(dtype)
    lora_a = (torch.randn(3, rank, in_features, generator=gen) / in_features ** 0.5).to(dtype)
    lora_b = torch.randn(3, out_features, rank, generator=gen).to(dtype)
    slots = torch.tensor([(t % 4) - 1 for t in range(tokens)])  # base, slot 0, 1, 2, base, ...
    batch = LoRABatch.from_token_slots(slots)
    want = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[t] += lora_b[s].double() @ (lora_a[s].double() @ x[t].double())
    got = y.clone()
    TritonLoRABackend(CONFIG, None).apply(got, x, lora_a, lora_b, batch)
    base = slots < 0
    assert torch.equal(got[base], y[base])
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7  # one bf16 ulp: the interpreter's conversion may truncate
    assert ((got.double() - want).abs() <= want.abs() * tol + 1e-3).all()


def test_without_a_gpu_or_the_interpreter_the_backend_says_what_to_use(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailable, match="--lora-backend cpu or torch, or set TRITON_INTERPRET=1"):
        TritonLoRABackend(CONFIG, None)
