"""The CPU host layer: ISA detection, threads, allocator, huge pages, OpenMP, C++ extension builds."""
