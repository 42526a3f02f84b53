"""The ``torch`` attention backend: the reference implementation and the CPU path.

KV layout per layer: ``[2, num_kv_heads, num_blocks, block_size, head_dim]``
(K then V). Head-major, so gathering a batch's blocks gives, per KV head, one
contiguous ``[seq, head_dim]`` run per request that matmul reads in place.

With ``kv_cache_dtype="fp8"`` the cache holds scaled float8 e4m3 (see ``kv_fp8``);
every query, fresh prefills included, attends to K/V as stored, so the output of a
request does not depend on how its prompt was chunked or prefix-cached.

In the engine's batch-invariant mode (``ModelConfig.batch_invariant``) every query token attends alone, over
its own keys read from the cache (see ``invariant``), so its bits do not depend on the batch at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from pagoda.config import CacheConfig, ModelConfig
from pagoda.plugins.attention.invariant import attend_per_token
from pagoda.plugins.attention.kv_fp8 import (dequantize_fp8, kv_cache_dtype_for, kv_scales, quantize_fp8, raw_bytes,
                                             uses_fp8, widen_fp8)
from pagoda.step import AttentionBatch


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             tokens: Optional[torch.Tensor]) -> None:
    """Store this step's K/V ([T, Hkv, D], already in the cache's dtype) into their slots of a
    [2, Hkv, num_blocks, bs, D] cache."""
    if tokens is not None:
        k, v = k[tokens], v[tokens]
    hkv, num_blocks, bs, d = kv_cache.shape[1:]
    cache = raw_bytes(kv_cache)
    cache[0].view(hkv, num_blocks * bs, d).index_copy_(1, slots, raw_bytes(k).transpose(0, 1))
    cache[1].view(hkv, num_blocks * bs, d).index_copy_(1, slots, raw_bytes(v).transpose(0, 1))


def quantize_step_kv(layer: Any, k: torch.Tensor, v: torch.Tensor, fp8: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """This step's K/V as the cache stores them, and the (k_scale, v_scale) a reader multiplies by."""
    if not fp8:
        return k, v, 1.0, 1.0
    k_scale, v_scale = kv_scales(layer)
    return quantize_fp8(k, k_scale), quantize_fp8(v, v_scale), k_scale, v_scale


@dataclass
class TorchAttentionMetadata:
    """Built once per step, read by every layer."""

    slot_mapping: torch.Tensor  # [num_written] int64, flat slot = block_id * block_size + offset
    written_tokens: Optional[torch.Tensor]  # which tokens those are, or None when all are (no padding)
    num_decodes: int  # the first num_decodes requests have exactly one query token
    # decodes in groups of similar length, each padded only to its own longest
    decode_groups: list["DecodeGroup"]
    # one entry per prefill request: (token start, token end, context len, seq len, block ids [n_blocks])
    prefills: list[tuple[int, int, int, int, torch.Tensor]]
    # for prefills with cached context: [n, seq_len] bool, True where attention is allowed
    prefill_masks: list[Any]
    # the batch-invariant mode: the step's batch, every token attending alone (the lists above stay empty)
    invariant_batch: Optional[AttentionBatch] = None


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [n] int64: which decode rows (tokens) are in the group
    block_ids: torch.Tensor  # [n * max_blocks] int64
    max_len: int  # padded key length (a multiple of block_size)
    mask: torch.Tensor  # [1, n, 1, max_len] float32, 0 or -inf
    lens: Optional[torch.Tensor] = None  # [n] int64: each request's keys
    window_masks: dict = field(default_factory=dict)  # sliding window -> its mask, made on first use

    def mask_for(self, window: Optional[int]) -> torch.Tensor:
        """The mask of a layer with ``window`` (None: the causal mask): keys before ``len - window`` hidden too."""
        if not window:
            return self.mask
        if window not in self.window_masks:
            keys = torch.arange(self.max_len)[None, :]
            hidden = (keys >= self.lens[:, None]) | (keys < self.lens[:, None] - window)
            self.window_masks[window] = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf")).view(
                1, len(self.lens), 1, self.max_len)
        return self.window_masks[window]


# Decodes are sorted by length and gathered this many at a time, so a batch mixing short and
# long contexts does not pad every request to the longest one.
DECODE_GROUP_SIZE = 16


class TorchAttentionBackend:
    """Paged attention in plain torch: index_copy_ writes, block gathers, matmul/SDPA."""

    name = "torch"
    # what layers may ask beyond causal attention (pagoda.modeling.layers.attention.ATTENTION_FEATURES): all of it
    attention_features = frozenset({"sliding_window", "logit_softcap", "sinks"})
    # rank for attention_backend="auto" per device (higher first; see pagoda.execution.build.auto_backend_order)
    auto_priority = {"cuda": 0, "cpu": 0}  # the reference: last on every device

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig) -> None:
        self.block_size = cache_config.block_size
        self.num_heads = model_config.num_heads
        self.num_kv_heads = model_config.num_kv_heads
        self.head_dim = model_config.head_dim
        self.group = self.num_heads // self.num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype_for(model_config, cache_config)
        self.fp8 = uses_fp8(cache_config)
        # the engine's batch-invariant mode: each query token's output depends on nothing but its own keys
        self.batch_invariant = bool(getattr(model_config, "batch_invariant", False))

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    def build_metadata(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        if self.batch_invariant:
            slots, written = batch.slots_to_write()
            return TorchAttentionMetadata(slots, written, batch.num_decodes, [], [], [], invariant_batch=batch)
        bs = self.block_size
        nd = batch.num_decodes
        groups = []
        if nd:
            seq_lens = batch.seq_lens[:nd].to(torch.int64)
            order = torch.argsort(seq_lens)
            for g0 in range(0, nd, DECODE_GROUP_SIZE):
                rows = order[g0:g0 + DECODE_GROUP_SIZE]
                lens = seq_lens[rows]
                nb = -(-int(lens.max()) // bs)
                mask = torch.zeros(len(rows), nb * bs)
                mask.masked_fill_(torch.arange(nb * bs)[None, :] >= lens[:, None], float("-inf"))
                block_ids = batch.block_tables[rows, :nb].reshape(-1).to(torch.int64)
                groups.append(DecodeGroup(rows, block_ids, nb * bs, mask.view(1, len(rows), 1, nb * bs), lens))
        prefills, masks = [], []
        qsl = batch.query_start_loc_list
        for i in range(nd, batch.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            seq_len = batch.seq_lens_list[i]
            ctx = seq_len - (end - start)
            n_blocks = -(-seq_len // bs)
            prefills.append((start, end, ctx, seq_len, batch.block_tables[i, :n_blocks].to(torch.int64)))
            if ctx:
                q_pos = torch.arange(ctx, seq_len)[:, None]
                masks.append(torch.arange(seq_len)[None, :] <= q_pos)
            else:
                masks.append(None)
        slots, written = batch.slots_to_write()
        return TorchAttentionMetadata(
            slot_mapping=slots,
            written_tokens=written,
            num_decodes=nd,
            decode_groups=groups,
            prefills=prefills,
            prefill_masks=masks,
        )

    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: TorchAttentionMetadata) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, Hkv, num_blocks, bs, D]
        hkv, d = kv_cache.shape[1], kv_cache.shape[-1]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k, v, k_scale, v_scale = quantize_step_kv(layer, k, v, self.fp8)
        write_kv(kv_cache, k, v, md.slot_mapping, md.written_tokens)
        if md.invariant_batch is not None:
            return attend_per_token(self, layer, q, kv_cache, md.invariant_batch, k_scale, v_scale).view(q.shape[0], -1)
        out = torch.empty_like(q)
        window = getattr(layer, "sliding_window", None)
        plain = not (getattr(layer, "logit_softcap", None) or getattr(layer, "sinks", None) is not None)
        for group in md.decode_groups:
            out[group.rows] = self._decode(q[group.rows], k_cache, v_cache, group, layer.scale, k_scale, v_scale,
                                           layer)
        for (start, end, ctx, seq_len, block_ids), mask in zip(md.prefills, md.prefill_masks):
            # 4-D inputs reach torch's flash kernel; 3-D ones its math path (3x slower at 300 tokens)
            qi = q[start:end].transpose(0, 1)  # [H, n, D]
            if ctx == 0:
                ki = dequantize_fp8(k[start:end], k_scale, q.dtype) if self.fp8 else k[start:end]
                vi = dequantize_fp8(v[start:end], v_scale, q.dtype) if self.fp8 else v[start:end]
                oi = self._attend_fresh(qi, ki.transpose(0, 1), vi.transpose(0, 1), layer, window, plain)
            else:
                ki = self._read(k_cache.index_select(1, block_ids), q.dtype).view(hkv, -1, d)[:, :seq_len]
                vi = self._read(v_cache.index_select(1, block_ids), q.dtype).view(hkv, -1, d)[:, :seq_len]
                if window:
                    mask = _allowed(ctx, seq_len, seq_len, window)
                # fp8: k_scale folds into the softmax scale, v_scale into the output
                oi = self._attend(qi, ki, vi, mask, layer, layer.scale * k_scale, plain)
                if v_scale != 1.0:
                    oi = oi * v_scale
            out[start:end] = oi[0].transpose(0, 1)
        return out.view(q.shape[0], -1)

    def _attend_fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, window: Optional[int],
                      plain: bool) -> torch.Tensor:
        """A fresh prompt's attention (q [H, n, D], k/v [Hkv, n, D]; no cached context): torch's flash kernel for
        a plain causal layer, else the masked path with the layer's window, soft-cap and sinks."""
        if plain and not window:
            return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=layer.scale,
                                                  enable_gqa=self.group > 1)
        n = q.shape[1]
        return self._attend(q, k, v, _allowed(0, n, n, window), layer, layer.scale, plain)

    @staticmethod
    def _read(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gathered cache rows in the compute dtype (fp8 widens exactly; scales are applied by the caller)."""
        return stored if stored.dtype == dtype else widen_fp8(stored, dtype)

    def _attend(self, qi: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor, allowed: torch.Tensor, layer: Any,
                scale: float, plain: bool) -> torch.Tensor:
        """``qi [H, n, D]`` over ``ki, vi [Hkv, L, D]`` where ``allowed [n, L]``: ``[1, H, n, D]``. SDPA for a
        layer without soft-cap or sinks; written out otherwise (scores in float32, as transformers' eager path)."""
        if plain:
            return F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=allowed, scale=scale,
                                                  enable_gqa=self.group > 1)
        if self.group > 1:
            ki, vi = ki.repeat_interleave(self.group, 0), vi.repeat_interleave(self.group, 0)
        scores = torch.matmul(qi, ki.transpose(-1, -2)).float() * scale  # [H, n, L]
        scores = _softcap(scores, layer).masked_fill(~allowed, float("-inf"))
        probs = _softmax_with_sinks(scores, layer, (-1, 1, 1)).to(vi.dtype)
        return torch.matmul(probs, vi)[None]

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
                scale: float, k_scale: float = 1.0, v_scale: float = 1.0, layer: Any = None) -> torch.Tensor:
        # decode only: one query token per request, grouped per KV head so K/V are never repeated
        nd, h, d = q.shape
        hkv = k_cache.shape[0]
        length = group.max_len
        keys = self._read(k_cache.index_select(1, group.block_ids), q.dtype).view(hkv, nd, length, d)
        values = self._read(v_cache.index_select(1, group.block_ids), q.dtype).view(hkv, nd, length, d)
        qg = q.view(nd, hkv, self.group, d).transpose(0, 1)  # [Hkv, nd, G, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * (scale * k_scale)  # [Hkv, nd, G, L]
        if layer is None:
            probs = torch.softmax(scores + group.mask, dim=-1).to(q.dtype)
        else:
            scores = _softcap(scores, layer) + group.mask_for(getattr(layer, "sliding_window", None))
            probs = _softmax_with_sinks(scores, layer, (hkv, 1, self.group, 1)).to(q.dtype)
        out = torch.matmul(probs, values)  # [Hkv, nd, G, D]
        if v_scale != 1.0:
            out = out * v_scale
        return out.transpose(0, 1).reshape(nd, h, d)


def _allowed(ctx: int, seq_len: int, keys: int, window: Optional[int]) -> torch.Tensor:
    """``[seq_len - ctx, keys]`` bool: the queries at positions ``ctx..seq_len-1`` see keys at or before their
    own position, and within ``window`` of it when one is given."""
    q_pos = torch.arange(ctx, seq_len)[:, None]
    k_pos = torch.arange(keys)[None, :]
    allowed = k_pos <= q_pos
    if window:
        allowed &= k_pos > q_pos - window
    return allowed


def _softcap(scores: torch.Tensor, layer: Any) -> torch.Tensor:
    cap = getattr(layer, "logit_softcap", None)
    return scores if not cap else torch.tanh(scores / cap) * cap


def _softmax_with_sinks(scores: torch.Tensor, layer: Any, sink_shape: tuple[int, ...]) -> torch.Tensor:
    """Softmax over the last axis; with the layer's sinks (one logit per head, viewed as ``sink_shape``) in the
    denominator only."""
    sinks = getattr(layer, "sinks", None)
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().view(sink_shape).expand(*scores.shape[:-1], 1)
    both = torch.cat((scores, sink), dim=-1)
    return torch.softmax(both - both.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
