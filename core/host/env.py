"""The host settings (``HostConfig``) and pagoda's environment variables, parsed one way.

The host settings (threads, the allocator, huge pages, which CPU kernels run)
are engine options, listed once, as the fields of ``HostConfig``; the variable
each names (``HOST_VARIABLES``) is only its default, used when the option is not
given, and read where an engine's config is built (``resolve_host_config``). An
empty variable counts as unset.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence, TypeVar, get_args, get_origin, get_type_hints

from pagoda.errors import ConfigError

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


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
CpuLinearKernel = Literal["auto", "onednn", "packed"]
QUANT_KERNELS: tuple[str, ...] = get_args(QuantKernel)


def _option(default: Any, variable: str, what: str, *, process_wide: bool = False,
            minimum: Optional[float] = None) -> Any:
    """A HostConfig field: its built-in default, the environment variable that is its default as an engine option,
    what it does (the option's help), whether it holds for the whole process, and the least number it takes."""
    return field(default=default, metadata={"variable": variable, "help": what, "process_wide": process_wide,
                                            "minimum": minimum})


@dataclass(frozen=True)
class HostConfig:
    """How the engine uses this machine: threads, OpenMP waiting, the allocator, huge pages, which CPU kernels run.

    The one list of the host settings: each field is an engine option (``EngineArgs`` and the command's flags are
    made from these fields) whose environment variable is only its default; the values here are the built-in
    defaults. Resolved once, by ``resolve_host_config`` when an engine's config is built. The per-engine ones
    travel with the engine's config to the components it builds (``ModelConfig.host``); the process-wide ones
    (``process_wide`` in a field's metadata) are applied to the process by ``pagoda.host.settings.HostTuning``.
    """

    cpu_threads: Optional[int] = _option(
        None, "PAGODA_CPU_THREADS", "threads computing on a CPU (per rank; torch's count is one per process)",
        process_wide=True, minimum=1)
    thread_recheck_seconds: float = _option(
        0.0, "PAGODA_THREAD_RECHECK_SECONDS",
        "seconds of stepping between re-measurements of a measured thread count (0: never, the default; 5 follows "
        "a machine whose load changes)", process_wide=True, minimum=0.0)
    omp_wait_policy: OmpWaitPolicy = _option(
        "auto", "PAGODA_OMP_WAIT_POLICY",
        "how idle OpenMP threads wait: spin briefly, sleep, or auto (spin on an idle machine); takes effect only if "
        "chosen before torch loads, as the pagoda command does", process_wide=True)
    malloc_tuning: bool = _option(
        True, "PAGODA_MALLOC_TUNING",
        "keep freed heap memory for reuse instead of returning it to the kernel (glibc)", process_wide=True)
    huge_pages: bool = _option(
        True, "PAGODA_HUGE_PAGES", "back the KV cache and the weights with 2 MiB transparent huge pages")
    kv_cache_prefault: bool = _option(
        False, "PAGODA_KV_CACHE_PREFAULT",
        "touch every page of a CPU KV cache when the engine starts, so that no request's K/V write waits for the "
        "kernel to map fresh memory (the whole cache is then resident; off: pages are mapped as blocks are first "
        "used). Off by default offline; pagoda serve turns it on unless it is given")
    cpu_isa: CpuIsa = _option(
        "auto", "PAGODA_CPU_ISA", "the highest CPU ISA level pagoda's kernels and dtype auto may use")
    cpu_native_build: bool = _option(
        True, "PAGODA_CPU_NATIVE",
        "build the C++ kernels for this CPU's ISA level (off: the compiler's default target)")
    fused_cpu_ops: bool = _option(
        True, "PAGODA_FUSED_CPU_OPS", "fused C++ kernels for RMSNorm, SiLU-and-mul, RoPE and small bf16 matmuls")
    onednn_packed_weights: bool = _option(
        True, "PAGODA_ONEDNN_PACKED", "pack bf16 linear weights in oneDNN's layout at load time (AVX-512 CPUs)")
    cpu_linear_kernel: CpuLinearKernel = _option(
        "auto", "PAGODA_CPU_LINEAR_KERNEL",
        "the bf16 linears' kernel on a CPU: onednn (oneDNN's packed GEMM on AVX-512, the GEMV and widened-tile GEMM "
        "on AVX2), packed (pagoda's packed bf16 GEMM, the batch-invariant mode's) or auto (the faster one here)")
    cpu_prefill_kernel: bool = _option(
        True, "PAGODA_CPU_PREFILL_KERNEL", "the cpu attention backend's C++ kernel for fresh prompts (off: SDPA)")
    quant_kernel: QuantKernel = _option(
        "auto", "PAGODA_QUANT_KERNEL",
        "the matmul of int-quantized weights: cpu (C++), triton, torch (reference) or auto (triton on a GPU, "
        "else cpu)")


@dataclass(frozen=True)
class HostOption:
    """One field of HostConfig as an engine option: what ``EngineArgs`` and the command's flags are made from."""

    name: str
    variable: str
    help: str
    kind: type  # bool, int or float; str for a choice
    choices: tuple[str, ...]  # the values of a choice, else ()
    default: Any  # the built-in default
    minimum: Optional[float]
    process_wide: bool


def _host_options() -> tuple[HostOption, ...]:
    hints = get_type_hints(HostConfig)
    options = []
    for f in dataclasses.fields(HostConfig):
        hint = hints[f.name]
        choices = get_args(hint) if get_origin(hint) is Literal else ()
        kind = str if choices else next((a for a in get_args(hint) if a is not type(None)), hint)
        options.append(HostOption(f.name, f.metadata["variable"], f.metadata["help"], kind, choices, f.default,
                                  f.metadata["minimum"], f.metadata["process_wide"]))
    return tuple(options)


# every host setting, in HostConfig's order
HOST_OPTIONS: tuple[HostOption, ...] = _host_options()
# engine option -> the environment variable that is its default
HOST_VARIABLES: dict[str, str] = {o.name: o.variable for o in HOST_OPTIONS}
# the choices of each enumerated host setting
HOST_CHOICES: dict[str, tuple[str, ...]] = {o.name: o.choices for o in HOST_OPTIONS if o.choices}
# the settings that hold for the whole process (threads, OpenMP, the allocator), not for one engine
PROCESS_WIDE: tuple[str, ...] = tuple(o.name for o in HOST_OPTIONS if o.process_wide)


def resolve_host_config(**given: Any) -> HostConfig:
    """The host settings: each option given (None: not given), else its environment variable, else the
    built-in default. A malformed variable is a ConfigError naming it and the values it accepts."""
    values = {}
    for option in HOST_OPTIONS:
        value = given.get(option.name)
        if value is None:
            if option.kind is bool:
                value = env_bool(option.variable, option.default)
            elif option.choices:
                value = env_choice(option.variable, option.choices, option.default)
            else:
                value = env_number(option.variable, option.kind, option.kind(option.minimum), option.default)
        values[option.name] = value
    return HostConfig(**values)


def host_config_of(model_config: Any) -> HostConfig:
    """The host settings a component is built with: its model config's (``ModelConfig.host``, the engine's),
    or the environment's for a config without them (a stand-in built by hand)."""
    host = getattr(model_config, "host", None)
    return host if host is not None else resolve_host_config()


def resolve_cpu_threads(given: Optional[int]) -> Optional[int]:
    """The ``cpu_threads`` option, else ``PAGODA_CPU_THREADS``, else None (measured at start-up)."""
    return given or resolve_host_config().cpu_threads
