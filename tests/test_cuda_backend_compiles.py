"""The cuda backend's sources compile: its CUDA kernels with the installed nvcc, for A100 (sm_80) and H100 (sm_90),
and its torch binding with the host compiler torch's extension loader builds it with.

This machine may have no GPU, so the kernels cannot run here; compiling them keeps
syntax and type errors from landing. Skipped only when nvcc (or g++, for the binding) is not installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig

import pytest
from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

from pagoda.plugins.attention.cuda_backend import CSRC

NVCC = shutil.which("nvcc")
GXX = shutil.which("g++")
pytestmark = pytest.mark.slow
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed here, so the cuda backend's kernels are "
                                                     "not compiled by this test (install the CUDA toolkit to run it)")


def includes() -> list[str]:
    dirs = [str(CSRC), *include_paths(), sysconfig.get_paths()["include"]]
    return [f"-I{d}" for d in dirs]


def compile_source(compiler: str, args: list[str]) -> str:
    result = subprocess.run([compiler, *args, *includes()], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{compiler} {' '.join(args)} failed:\n{result.stderr[-6000:]}"
    assert "warning" not in result.stderr.lower(), result.stderr[-6000:]
    return result.stderr


ARCHS = ("sm_80", "sm_90")


@needs_nvcc
def test_decode_kernels_compile_for_each_gpu_architecture(tmp_path):
    # one nvcc run for both architectures (its host-side passes once), with the flags torch's extension loader
    # adds (no implicit half/bf16 conversions)
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in ARCHS]
    report = compile_source(NVCC, [*gencode, "-O3", "--use_fast_math", *COMMON_NVCC_FLAGS, "-Xptxas", "-v",
                                   "-c", str(CSRC / "paged_attention.cu"), "-o", str(tmp_path / "paged_attention.o")])
    assert (tmp_path / "paged_attention.o").stat().st_size > 0
    # every kernel instantiation (3 dtypes x 5 head sizes, merges, KV writes) keeps its state in registers, on
    # each architecture
    spills = re.findall(r"Compiling entry function '\w+' for '(sm_\d+)'\n.*\n.*?(\d+) bytes spill stores", report)
    assert len(spills) == report.count("Compiling entry function"), report[-6000:]
    for arch in ARCHS:
        counts = {n for a, n in spills if a == arch}
        assert counts == {"0"}, (arch, report[-6000:])


@pytest.mark.skipif(GXX is None, reason="no g++ to compile the torch binding with")
def test_torch_binding_compiles_against_the_installed_torch_headers():
    """The binding holds no device code: torch's extension loader compiles it with the host compiler, and a full
    check of its types and templates (no code generation, which adds nothing a binding can get wrong) is enough."""
    compile_source(GXX, ["-fsyntax-only", "-std=c++20", "-fPIC", "-DTORCH_EXTENSION_NAME=pagoda_paged_attention",
                         str(CSRC / "binding.cpp")])
