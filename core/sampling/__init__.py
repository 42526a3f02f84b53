"""Choosing tokens: the sampler and the rejection sampler of speculative decoding."""
