"""The KV cache's books and its offload tiers.

- ``blocks``: the ``paged`` allocator: block ids, ref counts, the prefix cache, copy-on-write.
- ``swap``: CPU swap slots for preempted sequences' blocks.
- ``tiers``: the offload tiers' index (RAM, then disk), decided by the allocator.
- ``offload``: the runner's tier store, which copies the tensors and writes and reads the block files.
- ``connector``: the KV connector's transfers; ``handoff``: the request a prefill instance gets.
"""
