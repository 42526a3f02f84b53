"""The ``pagoda bench`` command: workloads, benchmarks, the HF baseline, roofline and profile."""
