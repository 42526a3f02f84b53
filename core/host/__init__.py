"""The CPU host layer: what pagoda sets up on the machine for an engine.

- ``cpu_isa``: the ISA level the kernels are built for; ``cpp_extension``: builds them (``include/``: the
  headers every kernel may include).
- ``env``: the host options and their environment variables; ``settings``: applies an engine's.
- ``threads``, ``openmp``, ``malloc``, ``hugepages``: compute threads, OpenMP waiting, allocator, huge pages.
- ``dtypes``: the dtype names pagoda accepts, what ``dtype auto`` is on this CPU, how the KV cache is stored.
"""
