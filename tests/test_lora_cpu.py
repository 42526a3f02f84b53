"""The ``cpu`` LoRA backend's C++ kernel against the torch backend and an exact reference: odd widths, ranks 1 to
64 (and the stacked slices of a fused layer), 1 to 37 tokens of several adapters mixed with base-model tokens, fp32
and bf16, on every ISA path this machine runs; the AVX-512 path is compiled where it cannot run."""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig

import pytest
import torch
from torch.utils.cpp_extension import include_paths

from pagoda.config import LoRAConfig, ModelConfig
from pagoda.execution import lora_backends
from pagoda.execution.lora_backends import CpuLoRABackend, TorchLoRABackend, lora_isa_path, lora_kernels_or_none
from pagoda.host import cpu_isa
from pagoda.host.cpp_extension import KERNEL_INCLUDE_DIR
from pagoda.step import LoRABatch
from pagoda.testing import check_lora_backend
from isa_builds import build_at

NAME = "pagoda_lora_cpu"


@pytest.fixture(scope="module", autouse=True)
def native():
    """The build an engine loads, compiled when the first test here runs: not while pytest collects the file, so
    the test workers compile different kernels at the same time instead of one after the other."""
    kernels = lora_kernels_or_none()
    if kernels is None:
        pytest.skip("the cpu LoRA kernel could not be compiled here")
    return kernels


# (tokens, in, out, rank rows): widths that are not multiples of 8 or 16, ranks 1 to 64 and 3 slices of 64
CASES = [(1, 576, 960, 48), (1, 37, 23, 1), (3, 100, 50, 7), (5, 64, 33, 16), (8, 129, 70, 64), (17, 576, 1536, 32),
         (37, 333, 61, 192), (26, 8, 9, 3), (2, 1536, 576, 16)]


BUILDS = {  # the build an engine loads; the AVX2 path (where the CPU runs it); the portable scalar path
    "native": lora_kernels_or_none,
    "avx2": lambda: build_at("avx2", NAME, lora_backends._SOURCE),
    "generic": lambda: build_at("generic", NAME, lora_backends._SOURCE),
}
EXPECTED_PATH = {"avx2": "avx2", "generic": "scalar"}


def random_case(tokens, in_features, out_features, rank, dtype, num_slots=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    y = torch.randn(tokens, out_features, generator=gen).to(dtype)
    lora_a = (torch.randn(num_slots, rank, in_features, generator=gen) / in_features ** 0.5).to(dtype)
    lora_b = torch.randn(num_slots, out_features, rank, generator=gen).to(dtype)
    # several adapters and base-model tokens (-1), interleaved; never all base when there is more than one token
    slots = torch.randint(-1, num_slots, (tokens,), generator=gen)
    if tokens > 1:
        slots[0], slots[-1] = 0, num_slots - 1
    return x, y, lora_a, lora_b, LoRABatch.from_token_slots(slots)


def exact(y, x, lora_a, lora_b, batch) -> torch.Tensor:
    """y + each adapter token's lora_b @ (lora_a @ x), in float64 from the same (rounded) inputs."""
    out = y.double().clone()
    for t, s in zip(batch.lora_rows.tolist(), batch.lora_row_slots.tolist()):
        out[t] += lora_b[s].double() @ (lora_a[s].double() @ x[t].double())
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    else:  # one bf16 rounding of the fp32 result (fp32 products and sums, rounded once into y)
        assert ((got.double() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-3).all()


@pytest.mark.parametrize("build", list(BUILDS))
def test_each_build_runs_its_isa_path(build):
    kernels = BUILDS[build]()
    assert kernels.isa_path() == EXPECTED_PATH.get(build, kernels.isa_path())


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens,in_features,out_features,rank", CASES)
def test_the_kernel_adds_each_tokens_own_adapter_term_like_the_torch_backend(build, dtype, tokens, in_features,
                                                                            out_features, rank):
    kernels = BUILDS[build]()
    x, y, lora_a, lora_b, batch = random_case(tokens, in_features, out_features, rank, dtype, seed=tokens + rank)
    base_rows = torch.nonzero(batch.token_slots < 0).flatten()
    got = y.clone()
    kernels.lora_apply(got, x, lora_a, lora_b, batch.lora_rows, batch.lora_row_slots)
    assert torch.equal(got[base_rows], y[base_rows]), "a base-model token's row changed"
    assert_close(got, exact(y, x, lora_a, lora_b, batch), dtype)
    torch_backend = y.clone()
    TorchLoRABackend(None, None).apply(torch_backend, x, lora_a, lora_b, batch)
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # the torch backend rounds its bf16 intermediates
    torch.testing.assert_close(got.float(), torch_backend.float(), rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shrink_and_expand_are_one_call_each_and_compose_to_apply(build, dtype):
    kernels = BUILDS[build]()
    x, y, lora_a, lora_b, batch = random_case(13, 200, 90, 24, dtype, seed=5)
    t = kernels.lora_shrink(x, lora_a, batch.lora_rows, batch.lora_row_slots)
    assert t.dtype == torch.float32 and t.shape == (batch.lora_rows.numel(), 24)
    shrunk = torch.stack([lora_a[s].double() @ x[r].double()
                          for r, s in zip(batch.lora_rows.tolist(), batch.lora_row_slots.tolist())])
    torch.testing.assert_close(t.double(), shrunk, rtol=1e-5, atol=1e-5)
    got, fused = y.clone(), y.clone()
    kernels.lora_expand(got, t, lora_b, batch.lora_rows, batch.lora_row_slots)
    kernels.lora_apply(fused, x, lora_a, lora_b, batch.lora_rows, batch.lora_row_slots)
    assert torch.equal(got, fused)


def test_the_kernel_reads_rows_of_wider_tensors(native):
    x_wide, y_wide = torch.randn(6, 80), torch.randn(6, 50)
    x, y = x_wide[:, :64], y_wide[:, 10:40]  # row strides 80 and 50
    lora_a, lora_b = torch.randn(2, 8, 64), torch.randn(2, 30, 8)
    batch = LoRABatch.from_token_slots(torch.tensor([1, -1, 0, 0, -1, 1]))
    want = exact(y, x, lora_a, lora_b, batch)
    before = y_wide.clone()
    native.lora_apply(y, x, lora_a, lora_b, batch.lora_rows, batch.lora_row_slots)
    assert_close(y, want, torch.float32)
    assert torch.equal(y_wide[:, :10], before[:, :10]) and torch.equal(y_wide[:, 40:], before[:, 40:])


def test_a_wrong_call_is_refused_with_what_is_wrong(native):
    x, y, lora_a, lora_b, batch = random_case(4, 32, 16, 8, torch.float32)
    with pytest.raises(RuntimeError, match="lora_a is BFloat16 but the activations are Float"):
        native.lora_apply(y, x, lora_a.bfloat16(), lora_b, batch.lora_rows, batch.lora_row_slots)
    with pytest.raises(RuntimeError, match=r"row_slots\[0\] = 7 is not a slot in \[0, 4\)"):
        native.lora_apply(y, x, lora_a, lora_b, torch.tensor([0]), torch.tensor([7]))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native.lora_apply(y.half(), x.half(), lora_a.half(), lora_b.half(), batch.lora_rows, batch.lora_row_slots)


def test_the_cpu_backend_meets_the_lora_backend_contract():
    check_lora_backend(CpuLoRABackend)


def test_the_cpu_backend_falls_back_to_torch_for_float16():
    backend = CpuLoRABackend(LoRAConfig(max_loras=4, max_lora_rank=8, max_cpu_loras=4), _model_config())
    x, y, lora_a, lora_b, batch = random_case(6, 32, 16, 8, torch.float16)
    want = y.clone()
    TorchLoRABackend(None, None).apply(want, x, lora_a, lora_b, batch)
    backend.apply(y, x, lora_a, lora_b, batch)
    assert torch.equal(y, want)


def test_the_benchmark_header_names_the_cpu_backends_isa_path():
    path = {"generic": "scalar", "avx2": "avx2"}.get(cpu_isa.cpu_isa(), "avx512")
    assert lora_isa_path("cpu") == f"cpu {path}" and lora_isa_path("torch") == "torch"


GXX = shutil.which("g++")


@pytest.mark.slow
@pytest.mark.skipif(GXX is None, reason="no g++ to compile the AVX-512 path with")
def test_the_avx512_path_compiles(tmp_path):
    """Compiled (not run: this CPU may lack AVX-512) with the flags of pagoda's avx512 level; the object holds
    512-bit code, so the AVX-512 branch is the one compiled."""
    if cpu_isa.LEVELS.index(cpu_isa.cpu_isa("auto")) >= cpu_isa.LEVELS.index("avx512"):
        kernels = build_at("avx512", NAME, lora_backends._SOURCE)
        assert kernels.isa_path() == "avx512"
        return
    obj = tmp_path / "lora_cpu.o"
    includes = [f"-I{d}" for d in (KERNEL_INCLUDE_DIR, *include_paths(), sysconfig.get_paths()["include"])]
    run = subprocess.run([GXX, "-std=c++20", "-O2", "-fPIC", "-fopenmp", "-DTORCH_EXTENSION_NAME=lora_avx512_check",
                          *cpu_isa._CFLAGS["avx512"], *includes, "-c", str(lora_backends._SOURCE), "-o", str(obj)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    objdump = shutil.which("objdump")
    if objdump is not None:
        disassembly = subprocess.run([objdump, "-d", str(obj)], capture_output=True, text=True).stdout
        assert re.search(r"%zmm\d", disassembly), "no 512-bit instruction in the avx512 build"


def _model_config() -> ModelConfig:
    return ModelConfig(model="", tokenizer="", served_model_name="kernel-test", hf_config={}, architecture="test",
                       dtype=torch.float32, max_model_len=64, seed=0, load_format="dummy", quantization=None,
                       quant_config=None, chat_template=None, vocab_size=64, hidden_size=32, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=32)
