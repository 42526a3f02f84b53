"""Building pagoda's C++ CPU kernels on first use, one way for every kernel file."""

from __future__ import annotations

import hashlib
import warnings
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from pagoda.host.cpu_isa import extension_build
from pagoda.host.env import HostConfig, resolve_host_config

# the headers every kernel may include (``#include "pagoda_torch.h"``: the part of torch a kernel binds with;
# ``"pagoda_float.h"``: dtype <-> fp32 conversions), on the include path of every build
KERNEL_INCLUDE_DIR = Path(__file__).with_name("include")


def load_cpu_extension(name: str, source: Path, extra_cflags: Sequence[str] = (),
                       host: Optional[HostConfig] = None) -> Any:
    """Compile ``source`` (once per machine and ISA level; torch's extension loader caches it) and import it,
    once per process for each build: engines whose host settings differ only in what a build does not depend
    on share one module.

    Built with ``-O3 -fopenmp`` and :data:`KERNEL_INCLUDE_DIR` on the include path, for the CPU's ISA level
    (``-march=native``; the flags of a lower level when the ``cpu_isa`` host setting of ``host`` caps it, under a
    name of its own) unless its ``cpu_native_build`` setting is off, which builds for the compiler's default
    target. ``host`` is the engine's settings (None: the environment's, for kernels used without an engine).
    Raises whatever the build raises (a missing compiler or ninja surfaces as many exception types).
    """
    settings = host if host is not None else resolve_host_config()
    return _load(name, Path(source), tuple(extra_cflags), settings.cpu_isa, settings.cpu_native_build)


@lru_cache(maxsize=None)
def _load(name: str, source: Path, extra_cflags: tuple[str, ...], cpu_isa: str, native_build: bool) -> Any:
    """One build, keyed by everything it depends on (a failed build is not cached: the next call tries again)."""
    if native_build:
        module_name, isa_flags = extension_build(name, cpu_isa)
    else:
        module_name, isa_flags = f"{name}_generic", []
    flags = ["-O3", "-fopenmp", *extra_cflags, *isa_flags]
    full_name = f"{module_name}_{_source_digest(source, flags)}"
    with _one_builder(full_name) as build_dir:
        built = build_dir / BUILT_STAMP
        if built.exists() and (build_dir / f"{full_name}.so").exists():
            # built before from the same text (maybe by another checkout of pagoda, whose path torch's build file
            # names: torch's loader would compile it again for this one); import that build
            return _import_build(full_name, build_dir)
        from torch.utils.cpp_extension import load  # (it imports setuptools: some 0.4 s, paid only to build)

        module = load(name=full_name, sources=[str(source)], extra_cflags=flags,
                      extra_include_paths=[str(KERNEL_INCLUDE_DIR)], verbose=False)
        built.write_text(f"{source}\n")
        return module


# written in a build's directory once torch's loader has built and imported it: the build is whole
BUILT_STAMP = "pagoda-built"


@contextmanager
def _one_builder(name: str) -> Iterator[Path]:
    """Hold an OS lock on ``name``'s build directory while torch's loader builds or imports it. The OS lets go of
    the lock when its holder dies, so a torch build lock found by its holder was left by a build that was killed
    (torch's loader would wait on it for ever): it is removed, with a warning. A live build by another process
    holds the lock, and this one waits for it, then imports what it built. Yields the build directory."""
    import fcntl

    build_dir = build_directory(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "pagoda-builder.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                warnings.warn(f"removing the build lock of pagoda's C++ kernel {name}, left by a build that did not "
                              f"finish ({stale})", RuntimeWarning, stacklevel=5)
                stale.unlink(missing_ok=True)
            yield build_dir
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_directory(name: str) -> Path:
    """Where torch's extension loader builds ``name``: under ``TORCH_EXTENSIONS_DIR``, else under torch's cache
    folder for this Python and torch's accelerator (``~/.cache/torch_extensions/py311_cpu``). Found without
    importing the loader, which imports setuptools: an engine's start whose kernels are all built imports neither."""
    import os
    import sys

    import torch
    from torch._appdirs import user_cache_dir

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accelerator = "rocm" + torch.version.hip.replace(".", "")
        elif torch.version.cuda is not None:
            accelerator = "cu" + torch.version.cuda.replace(".", "")
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(user_cache_dir(appname="torch_extensions")), f"{python}_{accelerator}")
    return Path(root) / name


def _import_build(name: str, build_dir: Path) -> Any:
    """Import the Python module ``name`` that torch's loader built in ``build_dir`` (``name.so``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, build_dir / f"{name}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_cpu_extension_or_none(name: str, source: Path, extra_cflags: Sequence[str] = (),
                               fallback: str = "the torch path", host: Optional[HostConfig] = None) -> Optional[Any]:
    """:func:`load_cpu_extension`, or None where the kernel cannot be built here, with one RuntimeWarning per
    process and build saying why and that ``fallback`` runs instead (the failure is remembered: the build is
    not tried again for every layer)."""
    settings = host if host is not None else resolve_host_config()
    return _load_or_none(name, Path(source), tuple(extra_cflags), fallback, settings.cpu_isa,
                         settings.cpu_native_build)


@lru_cache(maxsize=None)
def _load_or_none(name: str, source: Path, extra_cflags: tuple[str, ...], fallback: str, cpu_isa: str,
                  native_build: bool) -> Optional[Any]:
    try:
        return _load(name, source, extra_cflags, cpu_isa, native_build)
    except Exception as exc:  # a missing compiler or ninja surfaces as many exception types
        lines = str(exc).strip().splitlines()
        warnings.warn(f"could not compile pagoda's C++ kernel {name} ({exc.__class__.__name__}: "
                      f"{lines[-1] if lines else ''}); {fallback} runs instead", RuntimeWarning, stacklevel=4)
        return None


def _source_digest(source: Path, flags: Sequence[str]) -> str:
    """A short hash of everything a build's binary depends on, part of the module name: the kernel source, the
    headers it may include (the shared ones, and those beside it or below its folder), its flags and the torch it
    builds against. Not where the source or torch lie: every checkout of the same kernel text (a fresh clone, a
    second worktree, another virtual environment of the same torch) shares one build in torch's extension cache,
    and an edited source or header builds under a new name instead of importing the old build."""
    import torch

    digest = hashlib.sha256(source.read_bytes())
    headers = sorted(KERNEL_INCLUDE_DIR.glob("*.h")) + sorted(source.parent.rglob("*.h"))
    for header in headers:
        digest.update(header.name.encode())
        digest.update(header.read_bytes())
    digest.update(" ".join(flags).encode())
    digest.update(f"{torch.__version__} {torch.version.git_version}".encode())
    return digest.hexdigest()[:12]
