"""Choosing tokens.

- ``sampler``: the ``default`` sampler: penalties, bias, temperature, top-k/p, min-p, logprobs.
- ``rejection_sampler``: accepts or rejects speculative drafts against the target's distribution.
- ``structured``: structured outputs: the built-in backends (xgrammar, guidance), the token bitmask applied
  before sampling, and the engine's compile pool and cache.
"""
