"""The ``triton`` attention backend: PagedAttention kernels written in Triton.

KV layout per layer: ``[2, num_blocks, num_kv_heads, block_size, head_dim]``
(K then V). Block-major, head next: one block of one KV head is a contiguous
``[block_size, head_dim]`` run, so a program that owns a KV head reads whole
rows with wide coalesced loads.

Runs on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1`` (slow; that
is how the kernels are checked on machines without a GPU).

With ``kv_cache_dtype="fp8"`` the cache is float8_e4m3fn; the kernels see its
uint8 view and convert with bit arithmetic (any GPU, the interpreter too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from pagoda.config import CacheConfig, ModelConfig
from pagoda.errors import BackendUnavailable
from pagoda.plugins.attention.kv_fp8 import kv_cache_dtype_for, kv_scales, raw_bytes, uses_fp8
from pagoda.step import AttentionBatch

MAX_HEAD_DIM = 256


def interpreting() -> bool:
    """True when Triton kernels defined from now on run in its interpreter (on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kernel_modules() -> tuple[Any, Any, Any]:
    """The (kv_write, decode, prefill) kernel modules, defined in the current mode.

    Triton makes a kernel compiled or interpreted when it is defined, reading TRITON_INTERPRET
    then; modules first imported in the other mode are executed again, so a process (a test
    run, say) that imported them before setting TRITON_INTERPRET still gets working kernels.
    """
    import importlib

    from triton.runtime.interpreter import InterpretedFunction

    from pagoda.plugins.attention import triton_common, triton_decode, triton_kv_write, triton_prefill

    modules = (triton_common, triton_kv_write, triton_decode, triton_prefill)  # dependencies first
    jitted = (triton_common.reduce_max, triton_kv_write._kv_write_kernel, triton_decode._decode_kernel,
              triton_prefill._prefill_kernel)
    if any(isinstance(fn, InterpretedFunction) != interpreting() for fn in jitted):
        modules = tuple(importlib.reload(m) for m in modules)
    return modules[1:]


def check_triton_runnable(name: str) -> torch.device:
    """The device Triton kernels run on here; BackendUnavailable when there is none."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if interpreting():
        return torch.device("cpu")
    raise BackendUnavailable(
        f"the {name} attention backend needs a CUDA GPU (torch.cuda.is_available() is False here); "
        "use attention_backend='torch' (or 'auto'), or set TRITON_INTERPRET=1 before starting pagoda to run "
        "the Triton kernels in the (slow) interpreter on the CPU"
    )


def check_shapes(name: str, model_config: ModelConfig, cache_config: CacheConfig) -> None:
    if not 16 <= model_config.head_dim <= MAX_HEAD_DIM:
        raise BackendUnavailable(
            f"the {name} attention backend supports head_dim 16..{MAX_HEAD_DIM} (64, 80, 96, 128, 256 are "
            f"tested); this model has {model_config.head_dim}; use attention_backend='torch'"
        )


@dataclass
class TritonAttentionMetadata:
    """Built once per step on the kernels' device, read by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = skip
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    decode_plan: Any  # triton_decode.DecodePlan, or None without decodes
    prefill_plan: Any  # triton_prefill.PrefillPlan, or None without prefills
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32


class TritonAttentionBackend:
    """Triton kernels for the KV write, split-K paged decode and varlen paged prefill."""

    name = "triton"
    # rank for attention_backend="auto" per device (higher first; see pagoda.execution.build.auto_backend_order)
    auto_priority = {"cuda": 20}

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, *,
                 target_programs: Optional[int] = None, min_tokens_per_split: int = 256) -> None:
        self.device = check_triton_runnable(self.name)
        check_shapes(self.name, model_config, cache_config)
        # imported only now: TRITON_INTERPRET is read when the kernels are defined
        from pagoda.plugins.attention.triton_common import tiles_for

        self._kv_write, self._decode, self._prefill = kernel_modules()
        self.tiles = tiles_for(model_config.dtype, model_config.head_dim)
        self.block_size = cache_config.block_size
        self.num_heads = model_config.num_heads
        self.num_kv_heads = model_config.num_kv_heads
        self.head_dim = model_config.head_dim
        self.group = self.num_heads // self.num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype_for(model_config, cache_config)  # refuses a float dtype not the model's
        self.fp8 = uses_fp8(cache_config)
        if target_programs is None:
            # two waves of programs on the GPU; in the interpreter every program costs, so split rarely
            target_programs = (2 * torch.cuda.get_device_properties(0).multi_processor_count
                               if self.device.type == "cuda" else 1)
        self.target_programs = target_programs
        self.min_tokens_per_split = min_tokens_per_split

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    def build_metadata(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        dev = self.device
        nd = batch.num_decodes
        block_tables = batch.block_tables.to(dev, torch.int32)
        seq_lens = batch.seq_lens.to(dev, torch.int32)
        decode_plan = prefill_plan = None
        if nd:
            decode_plan = self.plan_decode(nd, max(batch.seq_lens_list[:nd]))
        if batch.num_reqs > nd:
            query_lens = np.diff(np.asarray(batch.query_start_loc_list[nd:]))
            prefill_plan = self._prefill.plan_prefill(query_lens, nd, self.group, self.tiles, dev)
        return TritonAttentionMetadata(
            slot_mapping=batch.slot_mapping.to(dev, torch.int64),
            num_decodes=nd,
            decode_block_tables=block_tables[:nd],
            decode_seq_lens=seq_lens[:nd],
            decode_plan=decode_plan,
            prefill_plan=prefill_plan,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=batch.query_start_loc.to(dev, torch.int32),
        )

    def plan_decode(self, num_decodes: int, max_seq_len: int) -> Any:
        """The split-K plan of this step's decodes, built once per step."""
        return self._decode.plan_decode(num_decodes, max_seq_len, self.num_heads, self.num_kv_heads, self.head_dim,
                                        self.target_programs, self.min_tokens_per_split, self.tiles.decode_tile_n,
                                        self.device)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: TritonAttentionMetadata, out: torch.Tensor,
               scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """q, out: [num_decodes, H, D]; kv_cache in q's dtype or uint8 (fp8 codes)."""
        self._decode.decode_attention(q, kv_cache, md.decode_block_tables, md.decode_seq_lens, out, scale,
                                      md.decode_plan, self.tiles, k_scale, v_scale)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Store K/V [T, Hkv, D] into their slots (slot_mapping [T] int64 on the device; -1 = skip)."""
        self._kv_write.write_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale)

    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: TritonAttentionMetadata, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, Hkv, block_size, D]; out: [T, H, D]
        if q.stride(-1) != 1:
            q = q.contiguous()
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
        k_scale, v_scale = kv_scales(layer) if self.fp8 else (1.0, 1.0)
        kv_cache = raw_bytes(kv_cache)  # fp8: the kernels read and write the bytes
        self.write_kv(k, v, kv_cache, md.slot_mapping, k_scale, v_scale)
        nd = md.num_decodes
        if nd:
            self.decode(q[:nd], kv_cache, md, out[:nd], layer.scale, k_scale, v_scale)
        if md.prefill_plan is not None:
            self._prefill.prefill_attention(q, kv_cache, md.block_tables, md.seq_lens, md.query_start_loc, out,
                                            layer.scale, md.prefill_plan, self.tiles, k_scale, v_scale)
        return out.view(q.shape[0], -1)
