"""LoRA backend checks: every adapter of a batch applied to its own tokens, and nothing to the base model's."""

from __future__ import annotations

import torch

from pagoda.config import LoRAConfig, ModelConfig
from pagoda.interfaces import LoRABackendFactory
from pagoda.step import LoRABatch
from pagoda.testing.contract import ContractError, Where

MAX_LORAS, RANK, IN, OUT = 3, 8, 48, 40


def check_lora_backend(factory: LoRABackendFactory, seed: int = 0) -> None:
    """Check a ``pagoda_lora_backends`` factory (``factory(lora_config, model_config)`` -> ``backend.apply``)
    against a token-by-token reference, ``y[t] += lora_b[s] @ (lora_a[s] @ x[t])`` for ``s = token_slots[t]``:

    - a mixed batch: tokens of three adapters interleaved with base-model tokens (slot -1), whose rows must
      stay exactly as they were;
    - a batch of decodes (one token per request, few tokens) and a long one (a prefill), since backends may
      take different paths by size;
    - a batch with no adapter token, and one whose tokens all use one adapter.

    Raises ContractError.
    """
    where = Where(getattr(factory, "__name__", repr(factory)), seed)
    backend = factory(LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=RANK, max_cpu_loras=MAX_LORAS),
                      _model_config())
    gen = torch.Generator().manual_seed(seed)
    lora_a = torch.randn(MAX_LORAS, RANK, IN, generator=gen)
    lora_b = torch.randn(MAX_LORAS, OUT, RANK, generator=gen)
    cases = {
        "mixed decodes": [0, -1, 2, 1, -1, 0],
        "a mixed prefill": torch.randint(-1, MAX_LORAS, (97,), generator=gen).tolist(),
        "base model only": [-1] * 5,
        "one adapter": [1] * 40,
    }
    for step, (name, slots) in enumerate(cases.items(), start=1):
        x = torch.randn(len(slots), IN, generator=gen)
        y = torch.randn(len(slots), OUT, generator=gen)
        expected = y.clone()
        for t, s in enumerate(slots):
            if s >= 0:
                expected[t] += lora_b[s] @ (lora_a[s] @ x[t])
        batch = LoRABatch.from_token_slots(torch.tensor(slots, dtype=torch.int64))
        backend.apply(y, x, lora_a, lora_b, batch)
        at = where.at(f"{step} ({name})")
        base = [t for t, s in enumerate(slots) if s < 0]
        if base and not torch.equal(y[base], expected[base]):
            raise at.fail("the backend's apply()", f"base-model rows {base[:5]} changed",
                          "tokens of slot -1 take no LoRA term", "the backend's apply(): slot -1 rows")
        err = (y - expected).abs().max().item() if len(slots) else 0.0
        if not err <= 1e-3 * max(1.0, expected.abs().max().item()):
            worst = int((y - expected).abs().max(dim=1).values.argmax())
            raise at.fail("the backend's apply()", f"token {worst} (slot {slots[worst]}) is off by {err:.3g}",
                          "each token gets its own slot's lora_b @ (lora_a @ x), added to y in place",
                          "the backend's apply(): its shrink, expand or slot gather")


def _model_config() -> ModelConfig:
    return ModelConfig(model="", tokenizer="", served_model_name="conformance", hf_config={},
                       architecture="conformance", dtype=torch.float32, max_model_len=256, seed=0,
                       load_format="dummy", quantization=None, quant_config=None, chat_template=None,
                       vocab_size=64, hidden_size=IN, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=IN)


__all__ = ["check_lora_backend", "ContractError"]
