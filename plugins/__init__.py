"""Built-in plugins of pagoda: schedulers, attention backends, quantization, speculative decoding, entrypoints."""
