"""Building pagoda's C++ CPU kernels on first use, one way for every kernel file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence


def load_cpu_extension(name: str, source: Path, extra_cflags: Sequence[str] = ()) -> Any:
    """Compile ``source`` (once per machine; torch's extension loader caches it) and import it.

    Built with ``-O3 -fopenmp`` and ``-march=native`` unless ``PAGODA_CPU_NATIVE=0``. Raises
    whatever the build raises (a missing compiler or ninja surfaces as many exception types).
    """
    from torch.utils.cpp_extension import load

    flags = ["-O3", "-fopenmp", *extra_cflags]
    if os.environ.get("PAGODA_CPU_NATIVE", "1") != "0":
        flags.append("-march=native")
    return load(name=name, sources=[str(source)], extra_cflags=flags, verbose=False)
