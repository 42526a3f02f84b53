"""The Triton attention kernels compile to PTX and cubins for A100 (sm_80) and H100 (sm_90).

The interpreter that checks the kernels' numbers on a CPU does not apply the GPU
compiler's rules (layouts, ``tl.dot`` shapes and types, register allocation), so
the kernels are also compiled here with Triton's own CUDA toolchain, which needs
no GPU. Each case is a configuration the backends launch, and none may spill
registers to local memory (ptxas -v), which would cost a large share of speed.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

try:  # Triton 3.9+: the compiler imports gluon, which refuses to load where triton.language was defined
    import triton.experimental.gluon  # noqa: F401  under TRITON_INTERPRET (conftest.py); load it while that holds
except ImportError:  # older Triton has no gluon
    pass

pytestmark = pytest.mark.slow

POINTERS = {
    # argument -> element type; "T" is the storage dtype of the case
    "q_ptr": "T", "k_ptr": "T", "v_ptr": "T", "cache_ptr": "T", "out_ptr": "T", "slot_ptr": "i64",
    "block_tables_ptr": "i32", "seq_lens_ptr": "i32", "query_start_loc_ptr": "i32", "tile_req_ptr": "i32",
    "tile_q0_ptr": "i32", "part_out_ptr": "fp32", "part_lse_ptr": "fp32",
}
I64_ARGS = {"stride_c_kv", "stride_c_block"}  # a large cache's strides exceed 32 bits
TL = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}


def jit_function(module_name: str, kernel_name: str, monkeypatch):
    """The kernel as a compilable JITFunction, even if its module was first defined under the interpreter."""
    from pagoda.plugins.attention.triton_backend import kernel_modules

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    modules = {m.__name__.rsplit(".", 1)[-1]: m for m in kernel_modules()}
    kernel = getattr(modules[module_name], kernel_name)
    assert isinstance(kernel, triton.runtime.JITFunction)
    return kernel


def compile_kernel(fn, dtype: str, constexprs: dict, num_warps: int, arch: int):
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "cache_ptr" and constexprs.get("KV_FP8"):
            signature[name] = "*u8"  # an fp8 cache is passed as its bytes
        elif name in POINTERS:
            signature[name] = "*" + (dtype if POINTERS[name] == "T" else POINTERS[name])
        elif name in ("scale_log2", "k_scale", "v_scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i64" if name in I64_ARGS else "i32"
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def ptxas_report(ptx: str, arch: int, tmp_path) -> str:
    """ptxas -v on the kernel's PTX, with the ptxas Triton itself uses for this architecture."""
    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"^\.target (\w+)", ptx, re.M).group(1)
    path = tmp_path / "kernel.ptx"
    path.write_text(ptx)
    result = subprocess.run([get_ptxas(arch).path, f"-arch={target}", "-v", str(path), "-o", os.devnull],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stderr


def cases() -> dict:
    """The configurations the backends launch: tile sizes and warps come from the backend's own table."""
    from pagoda.plugins.attention.triton_common import tiles_for

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    result = {}
    # fp8: an fp8 e4m3 KV cache (read and written as bytes) with the model in `dtype`
    for dtype, head_dim, group, split, fp8 in [("bf16", 128, 4, True, False), ("fp16", 80, 3, False, False),
                                               ("fp32", 256, 2, True, False), ("fp32", 128, 1, True, False),
                                               ("bf16", 128, 4, True, True), ("fp16", 64, 3, False, True)]:
        t = tiles_for(dtypes[dtype], head_dim)
        result[f"decode-{dtype}-d{head_dim}-gqa{group}{'-split' if split else ''}{'-fp8kv' if fp8 else ''}"] = (
            "triton_decode", "_decode_kernel", dtype, t.decode_warps, dict(
                GROUP=group, G_PAD=16, HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=16,
                TILE_N=t.decode_tile_n, IS_SPLIT=split, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
                DOT_DTYPE=TL[dtype], KV_FP8=fp8))
    for dtype, head_dim, group, fp8 in [("bf16", 128, 4, False), ("fp16", 96, 8, False), ("bf16", 256, 2, False),
                                        ("fp32", 256, 1, False), ("fp32", 64, 2, False), ("bf16", 128, 4, True),
                                        ("fp32", 64, 3, True)]:
        t = tiles_for(dtypes[dtype], head_dim)
        g_pad = triton.next_power_of_2(group)
        result[f"prefill-{dtype}-d{head_dim}-gqa{group}{'-fp8kv' if fp8 else ''}"] = (
            "triton_prefill", "_prefill_kernel", dtype, t.prefill_warps, dict(
                GROUP=group, G_PAD=g_pad, TILE_Q=max(1, t.prefill_rows // g_pad), HEAD_DIM=head_dim,
                D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=32, TILE_N=t.prefill_tile_n,
                DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", DOT_DTYPE=TL[dtype], KV_FP8=fp8))
    result["merge-splits-bf16-d256"] = ("triton_decode", "_merge_splits_kernel", "bf16", 4, dict(
        SPLITS_PAD=16, HEAD_DIM=256, D_PAD=256))
    for fp8 in (False, True):
        result[f"kv-write-bf16-d128{'-fp8kv' if fp8 else ''}"] = ("triton_kv_write", "_kv_write_kernel", "bf16", 4, dict(
            NUM_KV_HEADS=8, HEAD_DIM=128, D_PAD=128, HEADS_PAD=8, BLOCK_SIZE=16, TOKENS=1, KV_FP8=fp8))
    return result


CASES = cases()


@pytest.mark.parametrize("arch", [80, 90], ids=["sm_80", "sm_90"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_kernel_compiles_for_the_gpu_without_spilling_registers(case, arch, monkeypatch, tmp_path):
    module, kernel, dtype, num_warps, constexprs = CASES[case]
    fn = jit_function(module, kernel, monkeypatch)
    compiled = compile_kernel(fn, dtype, constexprs, num_warps, arch)
    assert len(compiled.asm["cubin"]) > 0
    report = ptxas_report(compiled.asm["ptx"], arch, tmp_path)
    assert "0 bytes spill stores" in report, report
