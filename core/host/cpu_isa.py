"""Which x86 instruction-set level pagoda's CPU code may use: what the CPU reports, capped on request.

The levels, lowest first:

- ``generic``: no AVX2 (an old x86 or another architecture); kernels built for the compiler's default.
- ``avx2``: AVX2 + FMA + F16C (first-generation AMD EPYC, most laptops and desktops).
- ``avx512``: AVX-512 F/BW/VL/DQ, no bf16 dot product.
- ``avx512_bf16``: AVX-512 with the bf16 dot product (``vdpbf16ps``): bf16 matmuls run natively.

The ``cpu_isa`` option (``--cpu-isa avx2``, default ``PAGODA_CPU_ISA``) caps the level, so a machine
with AVX-512 runs the code an AVX2-only machine runs: kernels are compiled for that level only, and
``dtype auto`` stops assuming native bf16 math. It is an engine's own: each level's build of a
kernel is compiled once per machine and loaded once per process, beside the builds of other
levels. torch's own kernels are capped by ``ATEN_CPU_CAPABILITY=avx2`` and
``ONEDNN_MAX_CPU_ISA=AVX2``, read when torch is imported (``make test-avx2`` sets all three).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Optional

from pagoda.errors import ConfigError
from pagoda.host.env import HOST_CHOICES, HOST_VARIABLES, env_choice

LEVELS = ("generic", "avx2", "avx512", "avx512_bf16")

# the cpuinfo flags each level needs on top of the level below it
_REQUIRED = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16",),
}

# gcc flags that build for exactly one level (no -march=native: that would take what this CPU has)
_CFLAGS = {
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def detected_level(flags: frozenset[str]) -> str:
    """The highest level whose flags (and every lower level's) are all in ``flags``."""
    level = "generic"
    for name in LEVELS[1:]:
        if not all(f in flags for f in _REQUIRED[name]):
            break
        level = name
    return level


def _checked_cap(cap: Optional[str]) -> str:
    """``cap``, or when None the environment's (``PAGODA_CPU_ISA``, else auto: code used without an engine);
    an unknown level is an error naming the choices."""
    if cap is None:
        cap = env_choice(HOST_VARIABLES["cpu_isa"], HOST_CHOICES["cpu_isa"], "auto")
    if cap != "auto" and cap not in LEVELS:
        raise ConfigError(f"cpu_isa {cap!r} is not a CPU level; use auto or one of {', '.join(LEVELS)}")
    return cap


def cpu_isa(cap: Optional[str] = None) -> str:
    """The level pagoda's CPU code uses: the detected one, lowered to ``cap`` (an engine's ``cpu_isa`` host
    setting; default: ``PAGODA_CPU_ISA``) unless that is ``auto``."""
    detected = detected_level(cpu_flags())
    cap = _checked_cap(cap)
    if cap == "auto":
        return detected
    return LEVELS[min(LEVELS.index(cap), LEVELS.index(detected))]


def is_capped(cap: Optional[str] = None) -> bool:
    """True when the cap lowers the level below what the CPU reports."""
    return cpu_isa(cap) != detected_level(cpu_flags())


def describe(cap: Optional[str] = None) -> str:
    """The level in words, for logs, benchmarks and skip reasons: ``avx2`` or ``avx2 (avx512_bf16 capped
    by --cpu-isa)``."""
    level, detected = cpu_isa(cap), detected_level(cpu_flags())
    return level if level == detected else f"{level} ({detected} capped by --cpu-isa)"


def extension_build(name: str, cap: Optional[str] = None) -> tuple[str, list[str]]:
    """The extension module name and the ISA flags for a C++ kernel built at the level ``cap`` allows
    (an engine's ``cpu_isa`` host setting; default: ``PAGODA_CPU_ISA``).

    Uncapped, the kernel is built with ``-march=native`` under its own name; capped, with the flags of
    that level under ``name_<level>``, so both builds live side by side in torch's extension cache.
    """
    if not is_capped(cap):
        return name, ["-march=native"]
    level = cpu_isa(cap)
    return f"{name}_{level}", list(_CFLAGS[level])

