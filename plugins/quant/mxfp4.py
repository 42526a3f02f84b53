"""MXFP4 checkpoints (``quant_method: mxfp4``), as gpt-oss is published.

Only the routed experts are quantized; attention, routers, embeddings and the LM head are stored in bf16
(the config's ``modules_to_not_convert``), so :meth:`Mxfp4Config.for_layer` leaves every linear layer dense.
Each expert projection is stored as two tensors:

- ``*_blocks`` uint8 ``[E, out, in / 32, 16]``: 32 4-bit values per block of 32 input columns, two per
  byte, the low nibble first; a value is an FP4 (e2m1) number, ``FP4_VALUES[nibble]``;
- ``*_scales`` uint8 ``[E, out, in / 32]``: each block's power-of-two scale as a biased exponent (E8M0,
  bias 127).

``W[e, o, i] = FP4_VALUES[nibble] * 2 ** (scale - 127)``. Every such product is exact in bf16, so the
experts are dequantized at load into the model's dtype without rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.errors import CheckpointError, ConfigError

# the 16 values of FP4 (e2m1), indexed by the 4-bit code: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # input columns per scale


class Mxfp4Config:
    """Parsed MXFP4 ``quantization_config``; it quantizes no linear layer of pagoda's, only the experts."""

    def __init__(self, model_config: Any, cfg: dict[str, Any]) -> None:
        if cfg.get("quant_method") != "mxfp4":
            raise ConfigError("mxfp4 reads checkpoints published in MXFP4 (quantization_config.quant_method "
                              "'mxfp4'); it does not quantize a dense checkpoint while loading: drop --quantization "
                              "mxfp4, or use --quantization int8|fp8")
        self.modules_to_not_convert = list(cfg.get("modules_to_not_convert") or [])

    def for_layer(self, prefix: str) -> None:
        return None

    def dequantize_expert(self, blocks: torch.Tensor, scales: torch.Tensor, expert: int, name: str,
                          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Expert ``expert`` of a stacked ``*_blocks`` / ``*_scales`` pair as ``[out, in]`` in ``dtype``."""
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise CheckpointError(f"MXFP4 tensors {name}_blocks / {name}_scales are {blocks.dtype} / {scales.dtype}; "
                                  "expected uint8 (packed FP4 codes and E8M0 exponents)")
        if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
            raise CheckpointError(f"MXFP4 tensors {name}_blocks {tuple(blocks.shape)} and {name}_scales "
                                  f"{tuple(scales.shape)} do not fit together: expected [E, out, in / 32, 16] and "
                                  "[E, out, in / 32]")
        codes = blocks[expert]  # [out, G, 16]
        table = torch.tensor(FP4_VALUES, dtype=torch.float32)
        values = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1)  # [out, G, 16, 2]
        values = values.reshape(codes.shape[0], codes.shape[1], BLOCK)
        exponents = scales[expert].to(torch.int32) - 127  # [out, G]
        return torch.ldexp(values, exponents[..., None]).reshape(codes.shape[0], -1).to(dtype)

