"""Attention backend checks: paged attention against a dense reference on random block layouts."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import torch

from pagoda.config import CacheConfig, ModelConfig
from pagoda.errors import BackendUnavailable
from pagoda.host.dtypes import stored_kv_dtype
from pagoda.interfaces import AttentionBackendFactory
from pagoda.registry.adapt import adapt_component
from pagoda.step import AttentionBatch
from pagoda.testing.contract import ContractError, Where

# (atol, rtol) per dtype: both sides accumulate in float32 and round once to the storage type
# every byte of a block no sequence holds: 0x5A5A5A5A is 1.5e16 as float32, 1.5e16 as bfloat16, 203.25 as float16,
# finite in every KV dtype, and no kernel writes it; zeros (what a cleared or untouched cache holds) are caught
UNOWNED_BYTE = 0x5A
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@dataclass(frozen=True)
class AttentionCase:
    """One layout: head counts and sizes, and per sequence its cached tokens and this step's new tokens."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    context_lens: tuple[int, ...]  # computed in the first step (0: the sequence starts in the step checked)
    query_lens: tuple[int, ...]  # the step checked: 1 is a decode (decodes are ordered first)


# odd token counts, contexts that end inside a block, grouped and plain multi-head attention
CASES = (
    AttentionCase(4, 2, 64, 16, context_lens=(17, 1, 33, 0, 5), query_lens=(1, 1, 7, 13, 1)),
    AttentionCase(6, 1, 32, 8, context_lens=(0, 9, 40), query_lens=(11, 1, 3)),
    AttentionCase(2, 2, 128, 32, context_lens=(63, 0), query_lens=(1, 70)),
)


class _Layer:
    """What a backend may read from the layer it serves (see ``pagoda.modeling.layers.attention.Attention``)."""

    def __init__(self, case: AttentionCase, scale: float) -> None:
        self.layer_idx = 0
        self.num_heads, self.num_kv_heads, self.head_dim = case.num_heads, case.num_kv_heads, case.head_dim
        self.scale = scale
        self.k_scale = self.v_scale = 1.0


def check_attention_backend(factory: AttentionBackendFactory, dtypes: tuple = (torch.float32, torch.bfloat16),
                            cases: tuple[AttentionCase, ...] = CASES, seed: int = 0, device: str = "cpu") -> None:
    """Check a ``pagoda_attention_backends`` factory: over two steps on shuffled block tables (the first
    writes each sequence's context, the second mixes decodes and prefill chunks that attend to it), every
    output matches dense causal attention with the layer's softmax scale, ``[T, H * D]``; blocks no sequence
    holds stay untouched; ``kv_cache_shape`` grows along one axis. A case the backend declines with
    BackendUnavailable is skipped; if it declines every case, that error is raised. Raises ContractError."""
    name = getattr(factory, "__name__", repr(factory))
    ran = 0
    unavailable: Optional[BackendUnavailable] = None
    for case_index, case in enumerate(cases):
        for dtype in dtypes:
            mc, cc = component_configs(case, dtype)
            try:
                backend = adapt_component(factory(mc, cc), "pagoda_attention_backends", name)
            except BackendUnavailable as exc:
                unavailable = exc
                continue
            where = Where(name, seed, f"case {case_index}: {case.num_heads} heads / {case.num_kv_heads} KV heads of "
                                      f"{case.head_dim}, blocks of {case.block_size}, "
                                      f"{str(dtype).removeprefix('torch.')}")
            _check_case(backend, case, mc, dtype, random.Random(seed * 1000 + case_index), device, where)
            ran += 1
    if not ran:
        raise unavailable or ContractError(f"{name}: no case to run")


def component_configs(case: AttentionCase, dtype: torch.dtype) -> tuple[ModelConfig, CacheConfig]:
    """Model and cache configs for one case's heads and blocks (no checkpoint behind them)."""
    longest = max(c + q for c, q in zip(case.context_lens, case.query_lens))
    mc = ModelConfig(model="", tokenizer="", served_model_name="conformance", hf_config={},
                     architecture="conformance", dtype=dtype, max_model_len=max(256, longest), seed=0,
                     load_format="dummy", quantization=None, quant_config=None, chat_template=None, vocab_size=128,
                     hidden_size=case.num_heads * case.head_dim, num_layers=1, num_heads=case.num_heads,
                     num_kv_heads=case.num_kv_heads, head_dim=case.head_dim)
    cc = CacheConfig(block_size=case.block_size, kv_cache_memory_bytes=1 << 20, kv_cache_dtype="auto",
                     enable_prefix_caching=False, num_gpu_blocks_override=None, swap_space_bytes=0,
                     preemption_mode="recompute", kv_allocator="conformance")
    return mc, cc


def _check_case(backend, case: AttentionCase, mc: ModelConfig, dtype: torch.dtype, rng: random.Random, device: str,
                where: Where) -> None:
    one, two, five = (tuple(backend.kv_cache_shape(n)) for n in (1, 2, 5))
    grows = [i for i, (a, b) in enumerate(zip(one, two)) if a != b]
    if len(one) != len(two) or len(grows) != 1 or five[grows[0]] != 5 * one[grows[0]]:
        raise where.at(0).fail("kv_cache_shape(1), (2), (5)", f"the shapes are {one}, {two}, {five}",
                               "exactly one axis grows with the block count", "the backend's kv_cache_shape()")
    bs, gen = case.block_size, torch.Generator().manual_seed(rng.randrange(1 << 30))
    seq_lens = [c + q for c, q in zip(case.context_lens, case.query_lens)]
    tables_needed = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(tables_needed) + 3  # blocks nobody holds, which must stay untouched
    # the last block is one of them: a write to slot -1 (a padding token) indexed from the end lands in it
    pool = list(range(num_blocks - 1))
    rng.shuffle(pool)
    tables, start = [], 0
    for n in tables_needed:
        tables.append(pool[start:start + n])
        start += n
    owned = {b for t in tables for b in t}
    # every sequence's q, k, v at all its positions, rounded to the model dtype
    q_all = [torch.randn(s, case.num_heads, case.head_dim, generator=gen).to(dtype) for s in seq_lens]
    k_all = [torch.randn(s, case.num_kv_heads, case.head_dim, generator=gen).to(dtype) for s in seq_lens]
    v_all = [torch.randn(s, case.num_kv_heads, case.head_dim, generator=gen).to(dtype) for s in seq_lens]
    kv_dtype = stored_kv_dtype(backend, dtype)
    cache = torch.zeros(backend.kv_cache_shape(num_blocks), dtype=kv_dtype, device=device)
    block_axis = grows[0]
    unowned = [b for b in range(num_blocks) if b not in owned]
    sentinel = torch.full((torch.empty((), dtype=kv_dtype).element_size(),), UNOWNED_BYTE, dtype=torch.uint8)
    sentinel = sentinel.view(kv_dtype)[0].to(device)  # the value whose every byte is UNOWNED_BYTE
    for b in unowned:
        cache.select(block_axis, b).fill_(sentinel)
    # a softmax scale other than 1/sqrt(head_dim): a backend must take the layer's
    layer = _Layer(case, 0.75 * case.head_dim ** -0.5)
    first = [(r, 0, c) for r, c in enumerate(case.context_lens) if c > 0]
    second = [(r, c, q) for r, (c, q) in enumerate(zip(case.context_lens, case.query_lens))]
    for step, items in enumerate((first, second)):
        if not items:
            continue
        items = sorted(items, key=lambda item: item[2] != 1)
        # the second step is padded: one padding token (slot -1) after its decodes, as a runner may pad a batch
        pad_at = sum(1 for item in items if item[2] == 1) if step == 1 else None
        batch = _batch(items, tables, bs, pad_at)
        q, k, v = (_strided(_pad(torch.cat([t[r][s:s + n] for r, s, n in items]), pad_at, gen))
                   for t in (q_all, k_all, v_all))
        at = where.at(f"{step + 1}" + (f" (padded: token {pad_at} has slot -1)" if pad_at is not None else ""))
        method = "build_metadata()"
        try:
            metadata = backend.build_metadata(batch)
            method = "forward()"
            out = backend.forward(layer, q.to(device), k.to(device), v.to(device), cache, metadata)
        except Exception as exc:
            padded = pad_at is not None
            raise at.fail(method, f"it raised {type(exc).__name__}: {exc}", "a backend runs every batch a runner "
                          "builds" + (", padded ones included (a padding token has slot -1 and is written nowhere: "
                                      "AttentionBatch.slots_to_write() gives the slots to write)" if padded else ""),
                          f"the backend's {method}" + (" (its K/V write of the padding token)" if padded else "")
                          ) from exc
        want_shape = (batch.num_tokens, case.num_heads * case.head_dim)
        if tuple(out.shape) != want_shape:
            raise at.fail("forward()", f"the output has shape {tuple(out.shape)}", f"forward returns [tokens, heads * "
                          f"head_dim], here {want_shape}", "the backend's forward()")
        # blocks first: a write outside the block tables also spoils the output, and is the cause to name
        for b in unowned:
            if not bool((cache.select(block_axis, b).float() == sentinel.float()).all()):
                padded = b == num_blocks - 1 and pad_at is not None
                raise at.fail("forward()", f"block {b}, which no sequence holds, was written (its bytes were all "
                              f"{UNOWNED_BYTE:#x} before the step)" + (
                                  "; it is the last block, where slot -1 of the padding token lands when indexed "
                                  "from the end" if padded else ""),
                              "forward() writes K/V only into the slots slot_mapping names (-1: a padding token, "
                              "written nowhere; AttentionBatch.slots_to_write() gives the slots to write)",
                              "the backend's forward() (its K/V write)")
        if pad_at is not None:
            out = torch.cat([out[:pad_at], out[pad_at + 1:]])
        expected = torch.cat([_reference(q_all[r], k_all[r], v_all[r], s, n, layer.scale) for r, s, n in items])
        atol, rtol = TOLERANCE.get(dtype, (2e-2, 2e-2))
        got = out.float().cpu()
        if not torch.allclose(got, expected, atol=atol, rtol=rtol):
            err = (got - expected).abs()
            token = int(err.amax(dim=1).argmax())
            row = next(i for i, (_, _, n) in enumerate(items) if token < sum(x[2] for x in items[:i + 1]))
            r, s, _ = items[row]
            raise at.fail(
                "forward()", f"the output differs from dense attention by up to {float(err.max()):.3g} (tolerance "
                f"{atol} + {rtol} x |value|), largest at sequence {r}, position "
                f"{s + token - sum(x[2] for x in items[:row])}; expected {expected[token, :3].tolist()}..., got "
                f"{got[token, :3].tolist()}...", "each token attends causally to its own sequence's K/V in its "
                "block table, with the layer's softmax scale (layer.scale)",
                "the backend's forward() (or build_metadata(), which prepares it)")


def _pad(t: torch.Tensor, pad_at: Optional[int], gen: torch.Generator) -> torch.Tensor:
    """``t`` with a random row (a padding token's) inserted at ``pad_at``, if given."""
    if pad_at is None:
        return t
    return torch.cat([t[:pad_at], torch.randn(1, *t.shape[1:], generator=gen).to(t.dtype), t[pad_at:]])


def _batch(items: list[tuple[int, int, int]], tables: list[list[int]], bs: int,
           pad_at: Optional[int] = None) -> AttentionBatch:
    """One step of ``(sequence, first new position, new tokens)``, decodes first, as the runner builds it;
    ``pad_at``: the index among the requests (after the decodes) of a padding request of one token, slot -1."""
    if pad_at is not None:
        items = items[:pad_at] + [(-1, 0, 1)] + items[pad_at:]
    query_lens = [n for _, _, n in items]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    seq_lens = [s + n for _, s, n in items]
    max_blocks = max(-(-s // bs) for s in seq_lens)
    block_tables = torch.zeros(len(items), max_blocks, dtype=torch.int32)
    slots = []
    for row, (r, s, n) in enumerate(items):
        if r < 0:  # padding: no blocks, written nowhere
            slots.append(-1)
            continue
        used = tables[r][:-(-(s + n) // bs)]
        block_tables[row, :len(used)] = torch.tensor(used, dtype=torch.int32)
        slots += [tables[r][p // bs] * bs + p % bs for p in range(s, s + n)]
    return AttentionBatch(
        num_reqs=len(items), num_decodes=sum(1 for n in query_lens if n == 1), num_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables, slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_list=qsl,
        seq_lens_list=seq_lens, max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=bs)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t [T, heads, D]`` as a view into wider rows, as the model's q, k and v are split from one projection."""
    rows = torch.zeros(t.shape[0], t.shape[1] * t.shape[2] + 8, dtype=t.dtype)
    view = rows[:, 4:4 + t.shape[1] * t.shape[2]]
    view.copy_(t.reshape(t.shape[0], -1))
    return view.view(t.shape)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, n: int, scale: float) -> torch.Tensor:
    """Dense causal attention of positions ``[start, start + n)`` over keys ``[0, position]``: ``[n, H * D]``."""
    heads, kv_heads = q.shape[1], k.shape[1]
    qs = q[start:start + n].float().transpose(0, 1)  # [H, n, D]
    ks = k[:start + n].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [H, S, D]
    vs = v[:start + n].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    scores = qs @ ks.transpose(1, 2) * scale  # [H, n, S]
    positions = torch.arange(start, start + n)[:, None]
    scores.masked_fill_(torch.arange(start + n)[None, :] > positions, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vs).transpose(0, 1).reshape(n, -1)
