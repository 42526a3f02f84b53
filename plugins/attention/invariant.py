"""Attention in the batch-invariant mode, in torch: one query token at a time, each over its own keys.

Every product has shapes that depend on nothing but the query's position (its number of keys), and its inputs
are fresh contiguous tensors, so the BLAS picks the same kernel and the same order for a token whether its
request runs alone or among others, its prompt was chunked or not, or its first blocks came from the prefix
cache. The reference for the ``cpu`` backend's kernel path, and the path of layers with a sliding window,
soft-cap or sinks there. One Python iteration per query token and layer: a reference, not a fast path.
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.step import AttentionBatch


def attend_per_token(backend: Any, layer: Any, q: torch.Tensor, kv_cache: torch.Tensor, batch: AttentionBatch,
                     k_scale: float, v_scale: float) -> torch.Tensor:
    """``q [T, H, D]`` of ``batch`` over the K/V already written to ``kv_cache [2, Hkv, num_blocks, bs, D]``:
    ``[T, H, D]``. ``backend``: a torch-layout backend (its ``group``, ``block_size`` and ``_read``)."""
    hkv, d = kv_cache.shape[1], kv_cache.shape[-1]
    bs, group = backend.block_size, backend.group
    window = getattr(layer, "sliding_window", None)
    cap = getattr(layer, "logit_softcap", None)
    sinks = getattr(layer, "sinks", None)
    out = torch.empty_like(q)
    qsl, seq_lens = batch.query_start_loc_list, batch.seq_lens_list
    for i in range(batch.num_reqs):
        start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
        if end == start:
            continue
        block_ids = batch.block_tables[i, :-(-seq_len // bs)].to(torch.int64)
        # [Hkv, seq_len, D]: this request's keys and values, in the compute dtype
        keys = backend._read(kv_cache[0].index_select(1, block_ids), q.dtype).view(hkv, -1, d)[:, :seq_len]
        values = backend._read(kv_cache[1].index_select(1, block_ids), q.dtype).view(hkv, -1, d)[:, :seq_len]
        ctx = seq_len - (end - start)
        for j, t in enumerate(range(start, end)):
            n = ctx + j + 1  # the keys token t sees: positions 0 .. ctx + j
            first = max(0, n - window) if window else 0
            kt = keys[:, first:n].contiguous()  # [Hkv, n', D]
            vt = values[:, first:n].contiguous()
            qt = q[t].reshape(hkv, group, d).clone()  # [Hkv, G, D]
            scores = torch.matmul(qt, kt.transpose(-1, -2)).float() * (layer.scale * k_scale)  # [Hkv, G, n']
            if cap:
                scores = torch.tanh(scores / cap) * cap
            if sinks is not None:
                both = torch.cat((scores, sinks.float().view(hkv, group, 1)), dim=-1)
                probs = torch.softmax(both - both.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs.to(vt.dtype), vt)  # [Hkv, G, D]
            out[t] = (o * v_scale if v_scale != 1.0 else o).reshape(-1, d)
    return out
