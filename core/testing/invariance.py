"""The batch-invariance check of an attention backend: the same sequence's tokens, attended alone in one step,
in chunks beside other sequences at another place in the batch, and after a block-aligned split (a prefix-cache
hit), must give the same bits."""

from __future__ import annotations

import dataclasses
import random

import torch

from pagoda.interfaces import AttentionBackendFactory
from pagoda.registry.adapt import adapt_component
from pagoda.testing.attention import AttentionCase, _batch, _Layer, _strided, component_configs
from pagoda.testing.contract import ContractError

CASE = AttentionCase(4, 2, 64, 16, context_lens=(0,), query_lens=(45,))  # heads and blocks; the steps are below
TARGET_LEN = 45  # the sequence checked: two full blocks and a part
OTHER_LENS = (19, 30)  # the sequences beside it


def check_batch_invariance(factory: AttentionBackendFactory, dtypes: tuple = (torch.float32, torch.bfloat16),
                           seed: int = 0) -> bool:
    """Check a ``pagoda_attention_backends`` factory's claim of batch invariance: built with
    ``model_config.batch_invariant`` on, a backend whose ``batch_invariant`` is True must give one sequence's
    tokens the same output bits (a) all in one step alone, (b) in two chunks of 23 and 22 tokens, the second
    between a decode and another prompt's chunk, (c) after its first 32 tokens were computed in an earlier step
    (a prefix-cache hit), each on its own shuffled block table; in float32 (where a changed order shows in
    almost every output) and bf16. Returns False (nothing checked) for a backend that does not claim it; raises
    ContractError naming the scenario and the first differing token otherwise."""
    return all(_check_dtype(factory, dtype, seed) for dtype in dtypes)


def _check_dtype(factory: AttentionBackendFactory, dtype: torch.dtype, seed: int) -> bool:
    name = getattr(factory, "__name__", repr(factory))
    mc, cc = component_configs(CASE, dtype)
    backend = adapt_component(factory(dataclasses.replace(mc, batch_invariant=True), cc),
                              "pagoda_attention_backends", name)
    if not backend.batch_invariant:
        return False
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = (TARGET_LEN,) + OTHER_LENS
    qkv = [tuple(torch.randn(n, h, CASE.head_dim, generator=gen).to(dtype)
                 for h in (CASE.num_heads, CASE.num_kv_heads, CASE.num_kv_heads)) for n in lens]
    layer = _Layer(CASE, 0.8 * CASE.head_dim ** -0.5)
    scenarios = {
        "alone, in one step": [[(0, 0, TARGET_LEN)]],
        "in two chunks beside other sequences": [[(1, 0, 18), (0, 0, 23), (2, 0, 10)],
                                                 [(1, 18, 1), (2, 10, 20), (0, 23, 22)]],
        "after a 32-token prefix computed earlier": [[(0, 0, 32)], [(0, 32, 13)]],
    }
    reference = None
    for what, steps in scenarios.items():
        out = _run(backend, steps, qkv, layer, rng)
        if reference is None:
            reference = out
            continue
        differ = (out.view(torch.int16 if dtype != torch.float32 else torch.int32)
                  != reference.view(torch.int16 if dtype != torch.float32 else torch.int32)).any(dim=1)
        if bool(differ.any()):
            token = int(differ.nonzero()[0])
            raise ContractError(
                f"{name}: claims batch_invariant, but in {str(dtype).removeprefix('torch.')} the sequence's token "
                f"{token} gets other bits {what} than "
                f"alone in one step (largest difference {float((out - reference).abs().max()):.3g}); with "
                "model_config.batch_invariant on, a token's output may depend only on its query and its keys, "
                "not on the step's other tokens, their order, or which keys were cached")
    return True


def _run(backend, steps, qkv, layer, rng: random.Random) -> torch.Tensor:
    """Run ``steps`` (lists of ``(sequence, first new position, new tokens)``) on a fresh cache with shuffled block
    tables; the target sequence's (sequence 0) outputs ``[TARGET_LEN, H * D]`` in position order."""
    bs = CASE.block_size
    lens = [t[0].shape[0] for t in qkv]
    needed = [-(-n // bs) for n in lens]
    pool = list(range(sum(needed) + 2))
    rng.shuffle(pool)
    tables, start = [], 0
    for n in needed:
        tables.append(pool[start:start + n])
        start += n
    cache = torch.zeros(backend.kv_cache_shape(len(pool)), dtype=qkv[0][0].dtype)
    target = {}
    for items in steps:
        items = sorted(items, key=lambda item: item[2] != 1)  # decodes first, as the runner orders them
        batch = _batch(items, tables, bs)
        q, k, v = (_strided(torch.cat([qkv[r][i][s:s + n] for r, s, n in items])) for i in range(3))
        out = backend.forward(layer, q, k, v, cache, backend.build_metadata(batch))
        row = 0
        for r, s, n in items:
            if r == 0:
                for j in range(n):
                    target[s + j] = out[row + j].clone()
            row += n
    return torch.stack([target[p] for p in range(lens[0])])
