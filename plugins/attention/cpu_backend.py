"""The ``cpu`` attention backend: the torch backend with a C++ kernel for paged attention.

Decodes and prefill chunks that follow cached context attend through
``cpu_kernels.cpp``, which reads K/V in place from the block pool (no gathered
copy), one (token, kv head) pair per work item, fp32 accumulation: on AVX-512
BF16 for bf16 models, on AVX2 for every dtype (fp32 math, 16-bit and fp8 values
widened in registers). Fresh prompts go through ``cpu_prefill.cpp``, a
flash-style causal kernel (AVX-512 BF16 for bf16 models; AVX2 in fp32 for bf16,
fp16 and fp32 ones), all of a step's prompts in one call; without it (and with
the engine's ``cpu_prefill_kernel`` host setting off: ``--no-cpu-prefill-kernel``) SDPA.
Prompt tokens that follow cached context (a prefix-cache hit, a later chunk) take the
flash-style kernel too, over their prompt's cached K/V read back from the block pool,
so they come out the same bits as in a cold prefill of the whole prompt.
Steps with many decodes on the generic loops (no AVX2) use the torch backend's
batched path, which wins there. ``isa_paths()`` names the path each kernel
takes. In the engine's batch-invariant mode every token, fresh prompts' included, goes through
``cpu_kernels.cpp`` (one (token, kv head) item over its keys in a fixed order, whatever else is in the
step), and layers with a sliding window, soft-cap or sinks through the torch backend's per-token path.
Outside that mode such layers decode through ``cpu_kernels.cpp`` and their prompts go through
``cpu_prefill.cpp`` too (both skip the key blocks before a token's window, mask the rest, soft-cap the
scores and put each head's sink in the softmax's denominator; without the prefill kernel, fresh prompts
take the torch backend's masked attention); a window no sequence of the step has outgrown hides no key,
so until then its layer is a plain one.
Both kernels include ``csrc/cpu_softmax.h``: the online softmax's update, 2^x
and the 8-lane pieces of their AVX2 paths. The kernels are compiled on first use
(about a minute) and cached by torch's extension loader, keyed on their source,
the header and the flags.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from pagoda.config import CacheConfig, ModelConfig
from pagoda.errors import BackendUnavailable
from pagoda.host.cpp_extension import load_cpu_extension, load_cpu_extension_or_none
from pagoda.host.env import HostConfig, host_config_of
from pagoda.plugins.attention.kv_fp8 import dequantize_fp8
from pagoda.plugins.attention.torch_backend import (TorchAttentionBackend, TorchAttentionMetadata, quantize_step_kv,
                                                     write_kv)
from pagoda.step import AttentionBatch

# On one thread, above this many decodes in a step, batched matmuls over gathered K/V beat the
# kernel's generic loops (this model family's shapes: 9 heads / 3 KV heads, head_dim 64, 300-token
# contexts: 0.62 vs 0.61 ms at 16 decodes, 1.7 vs 1.9 at 32, 2.7 vs 4.5 at 64). The AVX-512 BF16
# path for bf16 caches is faster than either at every size (64 decodes: 1.0 ms per layer against
# 2.4 for the generic loops), and so is the AVX2 path for every dtype (capped to AVX2, 64 decodes:
# fp32 7.8 ms against 15.9 batched, bf16 6.4 against 33.8), so those are always used where they apply.
MAX_KERNEL_DECODES = 16

_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_PREFILL_SOURCE = Path(__file__).with_name("cpu_prefill.cpp")
# the header both sources include (``#include "csrc/cpu_softmax.h"``, found next to them)
_SHARED_HEADER = Path(__file__).with_name("csrc") / "cpu_softmax.h"


@lru_cache(maxsize=None)
def _header_flags() -> tuple[str, ...]:
    """The shared header's digest as a build flag: the extension loader keys its cache on a kernel's source and
    flags, so an edited header builds both kernels anew instead of importing a build of the old one."""
    digest = hashlib.sha256(_SHARED_HEADER.read_bytes()).hexdigest()[:12]
    return (f"-DPAGODA_CPU_SOFTMAX_H={digest}",)


def load_kernels(host: Optional[HostConfig] = None) -> Any:
    """Compile (once per machine and ISA level) and import the C++ kernels, built as an engine's host settings
    say (None: the environment's)."""
    return load_cpu_extension("pagoda_cpu_attention", _SOURCE, _header_flags(), host=host)


def load_prefill_kernel(host: Optional[HostConfig] = None) -> Any:
    """The fresh-prompt kernel (``cpu_prefill.cpp``), or None (with one warning) where it cannot be built."""
    return load_cpu_extension_or_none("pagoda_cpu_prefill", _PREFILL_SOURCE, _header_flags(),
                                      fallback="SDPA for fresh prompts", host=host)


@dataclass
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_written] int64
    written_tokens: Optional[torch.Tensor]  # None when no token is padding
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    token_req: torch.Tensor  # [num_tokens] int32: the request of each token
    token_len: torch.Tensor  # [num_tokens] int32: keys the token attends to (0: left to SDPA)
    # fresh prefills (no cached context): (token start, token end)
    fresh_prefills: list[tuple[int, int]]
    # large decode groups go through the torch backend's batched gather + matmul instead
    torch_decode: Optional[TorchAttentionMetadata] = None
    # the step's batch: layers with a sliding window, soft-cap or sinks attend through the torch backend's
    # path, whose metadata is made from it on the first such layer of the step
    batch: Optional[AttentionBatch] = None
    torch_all: Optional[TorchAttentionMetadata] = None
    # prompt tokens after cached context (a prefix-cache hit, a later chunk), attended by the prefill kernel as
    # the same prompt's cold prefill would be: see :class:`ContextPrefills`
    context_prefills: Optional["ContextPrefills"] = None


@dataclass
class ContextPrefills:
    """The layout, made once per step, of prompts whose first tokens' K/V are in the cache: each is laid out
    whole in one buffer (its cached prefix read from the block pool, then this step's tokens), and the prefill
    kernel computes the query blocks of this step's tokens only. Its rows are the bits a cold prefill of the
    whole prompt gives (the kernel's rows do not depend on each other), which the paged kernel's are not."""

    total: int  # rows of the buffer
    ranges: list[int]  # [begin, end] per prompt, in buffer rows
    query_from: list[int]  # per prompt, the buffer row of its first token of this step
    cached_slots: torch.Tensor  # int64: the cache slots of every prompt's cached prefix, in buffer order
    cached_rows: torch.Tensor  # int64: their buffer rows
    step_tokens: torch.Tensor  # int64: this step's tokens of those prompts (rows of q/k/v)
    step_rows: torch.Tensor  # int64: their buffer rows
    blank_rows: torch.Tensor  # int64: cached rows the kernel's first query block reads as queries (zeroed)

    @classmethod
    def build(cls, batch: AttentionBatch, requests: list[tuple[int, int, int, int]]) -> "ContextPrefills":
        """``requests``: (request, first token, end token, cached context) of each such prompt."""
        bs = batch.block_size
        ranges, query_from, slots, cached_rows, step_tokens, step_rows, blank = [], [], [], [], [], [], []
        row = 0
        for i, start, end, ctx in requests:
            pos = torch.arange(ctx)
            slots.append(batch.block_tables[i, pos // bs].to(torch.int64) * bs + pos % bs)
            cached_rows.append(torch.arange(row, row + ctx))
            step_tokens.append(torch.arange(start, end))
            step_rows.append(torch.arange(row + ctx, row + ctx + end - start))
            blank.append(torch.arange(row + ctx // 16 * 16, row + ctx))  # the kernel's query blocks are 16 rows
            ranges += [row, row + ctx + end - start]
            query_from.append(row + ctx)
            row += ctx + end - start
        return cls(row, ranges, query_from, torch.cat(slots), torch.cat(cached_rows), torch.cat(step_tokens),
                   torch.cat(step_rows), torch.cat(blank))

    def attend(self, kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               out: torch.Tensor, scale: float, **shape: Any) -> None:
        """Write the outputs of this step's tokens of these prompts into ``out`` ([T, H, D]); ``shape``: the
        layer's ``window``, ``softcap`` and ``sinks``, as the kernel takes them."""
        hkv, num_blocks, bs, d = kv_cache.shape[1:]
        whole = []
        for cache, fresh in ((kv_cache[0], k), (kv_cache[1], v)):
            buf = fresh.new_empty((self.total, hkv, d))
            buf[self.cached_rows] = cache.view(hkv, num_blocks * bs, d).index_select(1, self.cached_slots
                                                                                     ).transpose(0, 1)
            buf[self.step_rows] = fresh[self.step_tokens]
            whole.append(buf)
        qb = q.new_empty((self.total,) + tuple(q.shape[1:]))
        qb[self.blank_rows] = 0
        qb[self.step_rows] = q[self.step_tokens]
        ob = torch.empty_like(qb)
        kernel.prefill_attention(qb, whole[0], whole[1], ob, self.ranges, scale, self.query_from, **shape)
        out[self.step_tokens] = ob[self.step_rows]


class CpuAttentionBackend(TorchAttentionBackend):
    """Same KV layout as ``torch``; a C++ kernel instead of gathers for cached-context attention."""

    name = "cpu"
    # layers with a sliding window, logit soft-cap or sinks attend through both C++ kernels too (steps the kernels
    # do not serve for them, through the torch backend's masked gathers and matmuls: see ``forward``)
    attention_features = frozenset({"sliding_window", "logit_softcap", "sinks"})
    # rank for attention_backend="auto" per device (higher first; see pagoda.execution.build.auto_backend_order)
    auto_priority = {"cpu": 20}

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig) -> None:
        super().__init__(model_config, cache_config)
        self.model_dtype = model_config.dtype
        if model_config.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise BackendUnavailable(f"the cpu kernels support float32, bfloat16 and float16, not {model_config.dtype}")
        try:
            self.kernels = load_kernels(host_config_of(model_config))
        except Exception as exc:  # a missing compiler or ninja surfaces as many exception types
            raise BackendUnavailable(f"could not compile the C++ attention kernels ({exc.__class__.__name__}: "
                                     f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''})") from None
        # decodes of a bf16 model over a bf16 or fp8 cache take the kernel's AVX-512 BF16 path where the
        # shapes allow it (fp8 codes are widened to bf16 exactly, head_dim <= 256)
        self.bf16_kernel = (model_config.dtype == torch.bfloat16 and self.kernels.has_bf16_kernel()
                            and (self.kv_cache_dtype == torch.bfloat16 or (self.fp8 and self.head_dim <= 256))
                            and self.head_dim % 32 == 0 and self.block_size % 16 == 0 and self.group <= 8)
        # which ISA path decodes take: AVX-512 BF16 (bf16 and fp8 caches of a bf16 model), AVX2 (fp32 math, every
        # dtype), or the generic loops (which hand large decode batches on one thread to torch's batched path)
        if self.bf16_kernel:
            self.decode_path = "avx512_bf16"
        elif self.kernels.has_avx2_kernel() and self.head_dim % 8 == 0 and self.block_size % 8 == 0:
            self.decode_path = "avx2"
        else:
            self.decode_path = "generic"
        # fresh prompts: a flash-style kernel, on AVX-512 BF16 for bf16 models (3-4x SDPA's at W1's lengths),
        # on AVX2 in fp32 for bf16, fp16 and fp32 models
        self.prefill_kernel = None
        host = host_config_of(model_config)  # the engine's
        if host.cpu_prefill_kernel:
            kernel = load_prefill_kernel(host)
            if (kernel is not None and kernel.supports_head_dim(self.head_dim)
                    and kernel.supports_dtype(str(model_config.dtype).removeprefix("torch."))):
                self.prefill_kernel = kernel

    def isa_paths(self) -> dict[str, str]:
        """The ISA path each of this backend's kernels takes for its model: ``decode attention`` and
        ``prefill attention`` (``sdpa``: torch's, no kernel of ours)."""
        prefill = self.prefill_kernel.isa_path() if self.prefill_kernel is not None else "sdpa"
        if self.batch_invariant:
            prefill = f"{self.decode_path} (the decode kernel, batch-invariant)"
        return {"decode attention": self.decode_path, "prefill attention": prefill}

    def build_metadata(self, batch: AttentionBatch) -> CpuAttentionMetadata:
        n = batch.num_reqs
        q_lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]  # [num_reqs]
        ctx = batch.seq_lens - q_lens
        token_req = torch.repeat_interleave(torch.arange(n, dtype=torch.int32), q_lens)
        # token i of a request sits at position ctx + i and sees keys [0, ctx + i]
        offset = torch.arange(batch.num_tokens, dtype=torch.int32) - batch.query_start_loc[:-1][token_req.long()]
        token_len = ctx[token_req.long()] + offset + 1
        fresh = []
        context: list[tuple[int, int, int, int]] = []
        torch_decode = None
        # an fp8 cache always takes the kernel: torch widens gathered fp8 rows ~10x slower than the kernel reads them
        batched = batch.num_decodes > MAX_KERNEL_DECODES and torch.get_num_threads() == 1 and not self.batch_invariant
        if batched and self.decode_path == "generic" and not self.fp8:
            torch_decode = super().build_metadata(batch)
            token_len[:batch.num_decodes] = 0
        qsl, seq_lens = batch.query_start_loc_list, batch.seq_lens_list
        for i in range(batch.num_decodes, n):
            start, end = qsl[i], qsl[i + 1]
            if seq_lens[i] == end - start and end - start > 1 and not self.batch_invariant:
                fresh.append((start, end))
                token_len[start:end] = 0
        if self._attends_cached_prompts(batch):
            # prompt tokens after cached context (one-token ones sit among the decodes) take the prefill kernel too
            for i in range(n):
                start, end = qsl[i], qsl[i + 1]
                ctx = seq_lens[i] - (end - start)
                if ctx > 0 and seq_lens[i] <= batch.prompt_lens_list[i]:
                    context.append((i, start, end, ctx))
                    token_len[start:end] = 0
        slots, written = batch.slots_to_write()
        token_len[batch.slot_mapping < 0] = 0  # padding tokens attend to nothing
        return CpuAttentionMetadata(slots, written, batch.block_tables, token_req, token_len.to(torch.int32), fresh,
                                    torch_decode, batch,
                                    context_prefills=ContextPrefills.build(batch, context) if context else None)

    def _attends_cached_prompts(self, batch: AttentionBatch) -> bool:
        """Whether prompt tokens after cached context take the prefill kernel (as the rest of their prompt did):
        with the kernel, a cache in the model's dtype, the batch's prompt lengths known, and outside the
        batch-invariant mode (which sends every token through the paged kernel)."""
        return (self.prefill_kernel is not None and self.kv_cache_dtype == self.model_dtype and not self.batch_invariant
                and batch.prompt_lens_list is not None and batch.num_tokens > 0)

    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: CpuAttentionMetadata) -> torch.Tensor:
        window = getattr(layer, "sliding_window", None)
        softcap = getattr(layer, "logit_softcap", None)
        sinks = getattr(layer, "sinks", None)
        if window and md.batch.max_seq_len <= window and not self.batch_invariant:
            window = None  # no sequence of the step has outgrown it: it hides no key
        if window or softcap or sinks is not None:
            # (prompt tokens after cached context are laid out only with the prefill kernel, which serves them)
            if self.batch_invariant or self.fp8 or md.torch_decode is not None:
                # these steps take the torch backend's path (masked gathers and matmuls) for such a layer
                if md.torch_all is None:
                    md.torch_all = TorchAttentionBackend.build_metadata(self, md.batch)
                return TorchAttentionBackend.forward(self, layer, q, k, v, kv_cache, md.torch_all)
            return self._forward_shaped(layer, q, k, v, kv_cache, md, window, softcap, sinks)
        k_scale = v_scale = 1.0
        if self.fp8:
            k, v, k_scale, v_scale = quantize_step_kv(layer, k, v, self.fp8)
        if md.written_tokens is None and k.stride(2) == 1 and v.stride(2) == 1:
            self.kernels.write_kv(kv_cache, k, v, md.slot_mapping)  # torch's index_copy_ is serial and slower
        else:
            write_kv(kv_cache, k, v, md.slot_mapping, md.written_tokens)
        out = self.kernels.paged_attention(q, kv_cache, md.block_tables, md.token_req, md.token_len, layer.scale,
                                           k_scale, v_scale)
        if md.torch_decode is not None:
            for group in md.torch_decode.decode_groups:
                out[group.rows] = self._decode(q[group.rows], kv_cache[0], kv_cache[1], group, layer.scale, k_scale,
                                               v_scale)
        if self.fp8 and md.fresh_prefills:
            # fresh prefills attend to K/V as stored too: [T, Hkv, D] fp8 -> dequantized model dtype
            k, v = dequantize_fp8(k, k_scale, q.dtype), dequantize_fp8(v, v_scale, q.dtype)
        if md.context_prefills is not None:
            md.context_prefills.attend(self.prefill_kernel, q, k, v, kv_cache, out, layer.scale)
        if self.prefill_kernel is not None and md.fresh_prefills:
            ranges = [i for pair in md.fresh_prefills for i in pair]
            self.prefill_kernel.prefill_attention(q, k, v, out, ranges, layer.scale)
            return out.view(q.shape[0], -1)
        for start, end in md.fresh_prefills:
            # 4-D inputs reach torch's flash kernel; 3-D ones its math path (3x slower at 300 tokens)
            qi = q[start:end].transpose(0, 1)  # [H, n, D]
            ki, vi = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)  # [Hkv, n, D]
            oi = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], is_causal=True, scale=layer.scale,
                                                enable_gqa=self.group > 1)
            out[start:end] = oi[0].transpose(0, 1)
        return out.view(q.shape[0], -1)

    def _forward_shaped(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                        md: CpuAttentionMetadata, window: Optional[int], softcap: Optional[float],
                        sinks: Optional[torch.Tensor]) -> torch.Tensor:
        """A layer with a sliding window, logit soft-cap or sinks: decodes through the paged kernel, prompts
        (fresh ones, and tokens after cached context) through the prefill kernel, both applying all three;
        without the prefill kernel, fresh prompts through the torch backend's masked attention."""
        if md.written_tokens is None and k.stride(2) == 1 and v.stride(2) == 1:
            self.kernels.write_kv(kv_cache, k, v, md.slot_mapping)
        else:
            write_kv(kv_cache, k, v, md.slot_mapping, md.written_tokens)
        if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()):
            sinks = sinks.float().contiguous()
        shape = dict(window=window or 0, softcap=softcap or 0.0, sinks=sinks)
        out = self.kernels.paged_attention(q, kv_cache, md.block_tables, md.token_req, md.token_len, layer.scale,
                                           **shape)
        if md.context_prefills is not None:
            md.context_prefills.attend(self.prefill_kernel, q, k, v, kv_cache, out, layer.scale, **shape)
        if self.prefill_kernel is not None and md.fresh_prefills:
            ranges = [i for pair in md.fresh_prefills for i in pair]
            self.prefill_kernel.prefill_attention(q, k, v, out, ranges, layer.scale, **shape)
            return out.view(q.shape[0], -1)
        plain = not softcap and sinks is None
        for start, end in md.fresh_prefills:
            qi, ki, vi = q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            out[start:end] = self._attend_fresh(qi, ki, vi, layer, window, plain)[0].transpose(0, 1)
        return out.view(q.shape[0], -1)
