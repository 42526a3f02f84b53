"""The ``cuda`` attention backend: a hand-written CUDA PagedAttention decode kernel.

The C++/CUDA sources live in ``csrc/`` and are compiled on first use with
torch's extension loader (cached under ``~/.cache/torch_extensions``, so later
starts only load the built module). The KV layout is the ``triton`` backend's,
``[2, num_blocks, num_kv_heads, block_size, head_dim]``; the KV write and the
decode run the CUDA kernels, prefill and chunked prefill run the Triton varlen
kernel.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagoda.config import CacheConfig, ModelConfig
from pagoda.errors import BackendUnavailable
from pagoda.plugins.attention.kv_fp8 import uses_fp8
from pagoda.plugins.attention.triton_backend import TritonAttentionBackend, TritonAttentionMetadata

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("binding.cpp", "paged_attention.cu")
HEAD_DIMS = (64, 80, 96, 128, 256)  # the instantiations in paged_attention.cu


@functools.lru_cache(maxsize=None)
def load_extension() -> Any:
    """Build (once per source version, cached on disk) and import the kernels."""
    from torch.utils.cpp_extension import load

    try:
        return load(
            name="pagoda_paged_attention",
            sources=[str(CSRC / name) for name in SOURCES],
            extra_include_paths=[str(CSRC)],
            extra_cflags=["-O3", "-std=c++20"],
            extra_cuda_cflags=["-O3", "--use_fast_math", "-lineinfo"],
        )
    except Exception as exc:  # the build raises RuntimeError, OSError or CalledProcessError
        raise BackendUnavailable(
            f"could not build the cuda backend's kernels from {CSRC} ({type(exc).__name__}: {exc}); it needs nvcc "
            "and a host C++ compiler matching torch's CUDA version; use attention_backend='triton' meanwhile"
        ) from None


@dataclass
class CudaDecodePlan:
    """Partitions (split-K) of one step's decodes; the buffers are shared by every layer."""

    partition_size: int
    max_parts: int
    part_out: torch.Tensor  # [num_decodes, num_heads, max_parts, head_dim] float32
    part_max: torch.Tensor  # [num_decodes, num_heads, max_parts] float32
    part_sum: torch.Tensor  # [num_decodes, num_heads, max_parts] float32


class CudaAttentionBackend(TritonAttentionBackend):
    """CUDA kernels for the KV write and the split-K paged decode; Triton for prefill."""

    name = "cuda"
    # rank for attention_backend="auto" per device (higher first; see pagoda.execution.build.auto_backend_order)
    auto_priority = {"cuda": 30}

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, *, partition_size: int = 512) -> None:
        if uses_fp8(cache_config):
            raise BackendUnavailable(
                "the cuda attention backend's kernels read K/V in the model dtype only, not an fp8 cache "
                f"(kv_cache_dtype={cache_config.kv_cache_dtype!r}); use attention_backend='triton', which reads "
                "fp8 on any GPU (or 'auto', which picks it), or kv_cache_dtype='auto'"
            )
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                "the cuda attention backend needs a CUDA GPU and a CUDA build of torch "
                f"(torch {torch.__version__}, torch.cuda.is_available() is False); use attention_backend='torch' "
                "or 'auto'"
            )
        if model_config.head_dim not in HEAD_DIMS or model_config.dtype not in (
                torch.float32, torch.float16, torch.bfloat16):
            raise BackendUnavailable(
                f"the cuda attention backend is built for head_dim {HEAD_DIMS} in float32/float16/bfloat16; this "
                f"model has head_dim {model_config.head_dim} in {model_config.dtype}; use attention_backend='triton'"
            )
        super().__init__(model_config, cache_config)
        # keys per partition: its scores sit in shared memory, 4 bytes x group x partition_size
        self.partition_size = partition_size
        self.ext = load_extension()

    def plan_decode(self, num_decodes: int, max_seq_len: int) -> CudaDecodePlan:
        max_parts = math.ceil(max_seq_len / self.partition_size)
        shape = (num_decodes, self.num_heads, max_parts) if max_parts > 1 else (0,)
        part_out = torch.empty(*shape, self.head_dim, dtype=torch.float32, device=self.device)
        part_max = torch.empty(shape, dtype=torch.float32, device=self.device)
        part_sum = torch.empty(shape, dtype=torch.float32, device=self.device)
        return CudaDecodePlan(self.partition_size, max_parts, part_out, part_max, part_sum)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: TritonAttentionMetadata, out: torch.Tensor,
               scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        # k_scale / v_scale are always 1 here: an fp8 cache is refused at construction
        plan: CudaDecodePlan = md.decode_plan
        self.ext.paged_attention_decode(out, q, kv_cache, md.decode_block_tables, md.decode_seq_lens, plan.part_out,
                                        plan.part_max, plan.part_sum, plan.partition_size, plan.max_parts, scale,
                                        torch.cuda.current_stream().cuda_stream)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        self.ext.write_kv(k, v, kv_cache, slot_mapping, torch.cuda.current_stream().cuda_stream)
