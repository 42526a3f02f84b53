"""pagoda's environment variables: parsed one way, read where an engine's config is built.

The host settings (threads, the allocator, huge pages, which CPU kernels run)
are engine options; the variable ``HOST_VARIABLES`` names for each is only its
default, used when the option is not given. An empty variable counts as unset.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, TypeVar

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
