"""The token bitmask of structured outputs: int32 ``[rows, ceil(vocab / 32)]``, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed (the layout xgrammar and llguidance fill)."""

from __future__ import annotations

import sys

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """``[num_rows, ceil(vocab / 32)]`` int32, every token allowed."""
    return torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, words]`` int32 -> ``[rows, vocab_size]`` bool, True where the token is allowed."""
    words = bitmask.contiguous().numpy()
    if sys.byteorder != "little":
        words = words.byteswap()
    # little-endian words: token t is bit t % 8 of byte t // 8
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of tokens ``bitmask`` does not allow to -inf, in place. ``logits``: ``[rows, vocab]``;
    ``bitmask``: ``[rows, words]``, row for row (columns past the vocabulary are ignored)."""
    allowed = allowed_tokens(bitmask, logits.shape[-1]).to(logits.device)
    logits.masked_fill_(~allowed, float("-inf"))
