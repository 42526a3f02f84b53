"""pagoda's C++ kernels build for 64-bit ARM (their x86 intrinsics are behind ISA guards, the scalar paths
stand alone), checked with a cross compiler where one is installed
(``apt-get install g++-aarch64-linux-gnu``). On ARM, /proc/cpuinfo has no x86 ``flags`` line, so
pagoda.host.cpu_isa detects the ``generic`` level and the kernels build with the compiler's -march=native."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from pagoda.host.cpp_extension import KERNEL_INCLUDE_DIR


ROOT = Path(__file__).resolve().parents[1]
KERNEL_DIRS = ("core/modeling/layers", "core/execution", "plugins/attention", "plugins/quant")
KERNELS = sorted(p for d in KERNEL_DIRS for p in (ROOT / d).glob("*.cpp"))
CROSS = shutil.which("aarch64-linux-gnu-g++")

# parsing torch's headers for ARM costs about a minute of CPU per kernel: run by `make check-arm`, not by
# every test run
pytestmark = pytest.mark.skipif(os.environ.get("PAGODA_CHECK_ARM") != "1", reason="make check-arm runs it")


@pytest.mark.skipif(CROSS is None, reason="no aarch64 cross compiler (apt-get install g++-aarch64-linux-gnu)")
@pytest.mark.parametrize("source", KERNELS, ids=lambda p: p.name)
def test_every_kernel_compiles_for_aarch64(source):
    torch_dir = Path(torch.__file__).parent
    # semantic analysis and template instantiation, no code generation: what an x86-only intrinsic breaks
    run = subprocess.run([CROSS, "-fsyntax-only", "-std=c++20", "-fopenmp", "-march=armv8.2-a", "-fPIC",
                          "-DTORCH_EXTENSION_NAME=arm_check", "-I", str(KERNEL_INCLUDE_DIR),
                          "-isystem", str(torch_dir / "include"),
                          "-isystem", str(torch_dir / "include/torch/csrc/api/include"),
                          "-isystem", sysconfig.get_paths()["include"], str(source)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
