"""Building a C++ kernel at a chosen ISA level, so one machine tests every path it can run."""

from pathlib import Path
from typing import Any, Sequence

import pytest

from pagoda.host import cpu_isa
from pagoda.host.cpp_extension import load_cpu_extension
from pagoda.host.env import HostConfig


def build_at(level: str, name: str, source: Path, extra_cflags: Sequence[str] = ()) -> Any:
    """The kernel ``source`` compiled for ``level`` (loaded once per process, built once per machine); skips the
    test where this CPU cannot run that level."""
    if cpu_isa.LEVELS.index(cpu_isa.cpu_isa("auto")) < cpu_isa.LEVELS.index(level):
        pytest.skip(f"the {level} path needs a {level} CPU; this one is {cpu_isa.describe('auto')}")
    return load_cpu_extension(name, source, extra_cflags, HostConfig(cpu_isa=level, cpu_native_build=True))
