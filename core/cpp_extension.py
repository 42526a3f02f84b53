"""Building pagoda's C++ CPU kernels on first use, one way for every kernel file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from pagoda.cpu_isa import extension_build


def load_cpu_extension(name: str, source: Path, extra_cflags: Sequence[str] = ()) -> Any:
    """Compile ``source`` (once per machine, ISA level and source text; torch's extension loader caches it)
    and import it.

    Built with ``-O3 -fopenmp`` for the CPU's ISA level (``-march=native``; the flags of a lower level
    when ``PAGODA_CPU_ISA`` caps it, under a name of its own) unless ``PAGODA_CPU_NATIVE=0``, which builds
    for the compiler's default target. Raises whatever the build raises (a missing compiler or ninja
    surfaces as many exception types).
    """
    from torch.utils.cpp_extension import load

    module_name, isa_flags = extension_build(name)
    if os.environ.get("PAGODA_CPU_NATIVE", "1") == "0":
        module_name, isa_flags = f"{name}_generic", []
    flags = ["-O3", "-fopenmp", *extra_cflags, *isa_flags]
    return load(name=module_name, sources=[str(_stable_source(module_name, source))], extra_cflags=flags,
                verbose=False)


def _stable_source(module_name: str, source: Path) -> Path:
    """``source`` copied under pagoda's cache at a path that does not depend on where pagoda is installed.

    The build file records the source's path, so a second checkout or a reinstall elsewhere would rebuild
    an identical kernel (half a minute each); the copy is rewritten only when the text changes.
    """
    from pagoda.default_model import cache_root

    text = source.read_bytes()
    target = cache_root() / "kernels" / module_name / source.name
    try:
        if target.exists() and target.read_bytes() == text:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{source.name}.{os.getpid()}")
        tmp.write_bytes(text)
        os.replace(tmp, target)  # atomic: a concurrent build never reads half a file
    except OSError:  # a read-only cache: build from where the source lies
        return source
    return target
