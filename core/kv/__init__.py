"""The KV cache: the paged block allocator (prefix cache, swap) and its offload tiers."""
