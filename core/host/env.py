"""The host settings (``HostConfig``) and pagoda's environment variables, parsed one way.

The host settings (threads, the allocator, huge pages, which CPU kernels run)
are engine options; the variable ``HOST_VARIABLES`` names for each is only its
default, used when the option is not given, and read once, where an engine's
config is built (``resolve_host_config``). An empty variable counts as unset.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence, TypeVar, get_args

from pagoda.errors import ConfigError

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

# engine option -> the environment variable that is its default
HOST_VARIABLES = {
    "cpu_threads": "PAGODA_CPU_THREADS",
    "thread_recheck_seconds": "PAGODA_THREAD_RECHECK_SECONDS",
    "omp_wait_policy": "PAGODA_OMP_WAIT_POLICY",
    "malloc_tuning": "PAGODA_MALLOC_TUNING",
    "huge_pages": "PAGODA_HUGE_PAGES",
    "cpu_isa": "PAGODA_CPU_ISA",
    "cpu_native_build": "PAGODA_CPU_NATIVE",
    "fused_cpu_ops": "PAGODA_FUSED_CPU_OPS",
    "onednn_packed_weights": "PAGODA_ONEDNN_PACKED",
    "cpu_prefill_kernel": "PAGODA_CPU_PREFILL_KERNEL",
    "quant_kernel": "PAGODA_QUANT_KERNEL",
}

Number = TypeVar("Number", int, float)


def parse_bool(value: str, name: str) -> bool:
    """``value`` of variable ``name`` as a boolean: 1/0, true/false, yes/no, on/off, in any case."""
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean; set it to one of {', '.join(TRUE_WORDS)} (on) or "
                      f"{', '.join(FALSE_WORDS)} (off), in any case, or unset it for the default")


def parse_choice(value: str, name: str, choices: Sequence[str]) -> str:
    """``value`` of variable ``name`` as one of ``choices`` (compared in lower case)."""
    word = value.strip().lower()
    if word not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices)}; set it to one of them, "
                          "or unset it for the default")
    return word


def parse_number(value: str, name: str, kind: type[Number], minimum: Number) -> Number:
    """``value`` of variable ``name`` as an int or a float, at least ``minimum``."""
    what = "a whole number" if kind is int else "a number"
    try:
        number = kind(value.strip())
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ConfigError(f"{name}={value!r} is not {what} >= {minimum}; set it to one, or unset it for the default")
    return number


def _raw(name: str) -> Optional[str]:
    value = os.environ.get(name, "")
    return value if value.strip() else None


def env_bool(name: str, default: bool) -> bool:
    """Variable ``name`` as a boolean (see ``parse_bool``), ``default`` when unset."""
    value = _raw(name)
    return default if value is None else parse_bool(value, name)


def env_choice(name: str, choices: Sequence[str], default: str) -> str:
    """Variable ``name`` as one of ``choices``, ``default`` when unset."""
    value = _raw(name)
    return default if value is None else parse_choice(value, name, choices)


def env_number(name: str, kind: type[Number], minimum: Number, default: Optional[Number]) -> Optional[Number]:
    """Variable ``name`` as a number >= ``minimum``, ``default`` when unset."""
    value = _raw(name)
    return default if value is None else parse_number(value, name, kind, minimum)


OmpWaitPolicy = Literal["auto", "spin", "sleep"]
CpuIsa = Literal["auto", "generic", "avx2", "avx512", "avx512_bf16"]
QuantKernel = Literal["auto", "cpu", "torch", "triton"]
QUANT_KERNELS: tuple[str, ...] = get_args(QuantKernel)


@dataclass(frozen=True)
class HostConfig:
    """How the engine uses this machine: OpenMP waiting, the allocator, huge pages, which CPU kernels run.

    Each field is an engine option whose environment variable (``pagoda.host.env.HOST_VARIABLES``) is only its
    default; the values here are the built-in defaults. Resolved once, by ``resolve_host_config`` when an
    engine's config is built, and applied by ``pagoda.host.settings.apply_host_settings`` when the engine is built.
    (The thread count is ``ParallelConfig.cpu_threads``.)
    """

    thread_recheck_seconds: float = 0.0  # how often a measured thread count is measured again (0: never)
    omp_wait_policy: str = "auto"  # an OmpWaitPolicy; takes effect only if chosen before torch loads
    malloc_tuning: bool = True  # keep freed heap memory for reuse (pagoda.host.malloc)
    huge_pages: bool = True  # 2 MiB pages for the KV cache, the weights and the heap (pagoda.host.hugepages)
    cpu_isa: str = "auto"  # a CpuIsa: the highest ISA level pagoda's CPU code may use (pagoda.host.cpu_isa)
    cpu_native_build: bool = True  # C++ kernels for this CPU's level; off: the compiler's default target
    fused_cpu_ops: bool = True  # fused RMSNorm / SiLU-and-mul / RoPE / GEMV kernels (pagoda.modeling.layers.fused_ops)
    onednn_packed_weights: bool = True  # bf16 weights in oneDNN's blocked layout (pagoda.modeling.layers.onednn)
    cpu_prefill_kernel: bool = True  # the cpu attention backend's kernel for fresh prompts
    quant_kernel: str = "auto"  # a QuantKernel: the int-weight matmul of quantized layers


# the choices of each enumerated host setting
HOST_CHOICES: dict[str, tuple[str, ...]] = {
    "omp_wait_policy": get_args(OmpWaitPolicy),
    "cpu_isa": get_args(CpuIsa),
    "quant_kernel": QUANT_KERNELS,
}


def resolve_host_config(**given: Any) -> HostConfig:
    """The host settings: each option given (None: not given), else its environment variable, else the
    built-in default. A malformed variable is a ConfigError naming it and the values it accepts."""
    values = {}
    for f in dataclasses.fields(HostConfig):
        value = given.get(f.name)
        if value is None:
            variable = HOST_VARIABLES[f.name]
            if isinstance(f.default, bool):
                value = env_bool(variable, f.default)
            elif f.name in HOST_CHOICES:
                value = env_choice(variable, HOST_CHOICES[f.name], f.default)
            else:
                value = env_number(variable, float, 0.0, f.default)
        values[f.name] = value
    return HostConfig(**values)


def resolve_cpu_threads(given: Optional[int]) -> Optional[int]:
    """The ``cpu_threads`` option, else ``PAGODA_CPU_THREADS``, else None (measured at start-up)."""
    return given or env_number(HOST_VARIABLES["cpu_threads"], int, 1, None)
