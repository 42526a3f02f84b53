"""Bit packing of the ecosystem's quantized layouts, and pagoda's own runtime layout.

Every layout stores unsigned ``bits``-wide integers inside int32 words; they
differ in which dimension is packed and in which order values sit in a word:

- AWQ ("GEMM" version, AutoAWQ): ``[in, out / 8]``, packed along the output
  dimension, nibble ``i`` of a word holding output column ``AWQ_ORDER[i]`` of
  its group of eight.
- GPTQ (AutoGPTQ / GPTQModel): ``qweight [in * bits / 32, out]`` packed along
  the input dimension, ``qzeros [groups, out * bits / 32]`` along the output
  dimension, value ``j`` of a word at bit ``j * bits``.
- compressed-tensors "pack-quantized": ``[out, in * bits / 32]`` packed along
  the input dimension in the same sequential order, values offset by
  ``2 ** (bits - 1)`` so signed integers become unsigned.

At run time pagoda keeps every int layout as uint8 ``[out, in * bits / 8]``
(two 4-bit values per byte, see ``pack_uint8``), which unpacks in two cheap ops.
"""

from __future__ import annotations

import torch

# nibble i of an AWQ word holds output column AWQ_ORDER[i] of its group of 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# column j of an AWQ group of 8 sits in nibble AWQ_REVERSE_ORDER[j]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Sequential unpacking: value ``j`` of each int32 word at bit ``j * bits``.

    ``packed`` is int32; the result is int32 with ``dim`` grown ``32 / bits``
    times, values in ``[0, 2**bits)``.
    """
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)  # [per_word]
    moved = packed.movedim(dim, -1).unsqueeze(-1)  # [..., n, 1]
    values = (moved >> shifts) & ((1 << bits) - 1)  # [..., n, per_word]; >> on int32 is arithmetic, & masks it
    values = values.reshape(*moved.shape[:-2], moved.shape[-2] * per_word)
    return values.movedim(-1, dim)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`unpack_int32`; ``values`` in ``[0, 2**bits)``, ``dim`` divisible by ``32 / bits``."""
    per_word = 32 // bits
    moved = values.to(torch.int64).movedim(dim, -1)
    moved = moved.reshape(*moved.shape[:-1], moved.shape[-1] // per_word, per_word)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (moved << shifts).sum(-1)  # [..., n / per_word] as unsigned 32-bit in int64
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ ``[rows, out / 8]`` int32 -> ``[rows, out]`` int32 in column order."""
    nibbles = unpack_int32(packed, 4, dim=1)  # nibble order
    rows, cols = nibbles.shape
    order = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
    return nibbles.view(rows, cols // 8, 8).index_select(2, order).reshape(rows, cols)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """``[rows, out]`` values in ``[0, 16)`` -> AWQ ``[rows, out / 8]`` int32."""
    rows, cols = values.shape
    order = torch.tensor(AWQ_ORDER, device=values.device)
    interleaved = values.reshape(rows, cols // 8, 8).index_select(2, order).reshape(rows, cols)
    return pack_int32(interleaved, 4, dim=1)


def pack_uint8(values: torch.Tensor, bits: int) -> torch.Tensor:
    """pagoda's runtime layout: ``[out, in]`` values -> uint8 ``[out, in * bits / 8]``.

    8-bit values are stored as they are. 4-bit rows are split in halves: byte
    ``k`` holds column ``k`` in its low nibble and column ``k + in / 2`` in its
    high nibble, so unpacking writes two contiguous blocks (no interleaving
    copy). An odd ``in`` is padded with a zero value.
    """
    values = values.to(torch.uint8)
    if bits == 8:
        return values.contiguous()
    if values.shape[1] % 2:
        values = torch.nn.functional.pad(values, (0, 1))
    half = values.shape[1] // 2
    return (values[:, :half] | (values[:, half:] << 4)).contiguous()


def unpack_uint8(packed: torch.Tensor, bits: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Inverse of :func:`pack_uint8`, converting to ``dtype`` while unpacking: ``[out, in]`` (in padded to even)."""
    if bits == 8:
        return packed.to(dtype)
    rows, half = packed.shape
    out = torch.empty(rows, 2 * half, dtype=dtype, device=packed.device)
    out[:, :half] = packed & 0xF  # the uint8 -> dtype conversion happens in these copies
    out[:, half:] = packed >> 4
    return out
