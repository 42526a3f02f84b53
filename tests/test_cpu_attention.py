"""The ``cpu`` backend's C++ paged-attention kernel against the ``torch`` reference backend."""

from types import SimpleNamespace

import pytest
import torch

from pagoda.host import cpu_isa
from pagoda.plugins.attention.cpu_backend import CpuAttentionBackend
from pagoda.plugins.attention.torch_backend import TorchAttentionBackend
from pagoda.step import AttentionBatch


def _batch(specs, block_size, num_blocks, gen):
    """specs: (cached context, query length) per request, decodes first."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, qsl, seq_lens = [], [], [0], []
    for ctx, qlen in specs:
        total = ctx + qlen
        table = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, total)]
        qsl.append(qsl[-1] + qlen)
        seq_lens.append(total)
    block_tables = torch.zeros(len(specs), max(len(t) for t in tables), dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
    return AttentionBatch(
        num_reqs=len(specs), num_decodes=sum(1 for _, q in specs if q == 1), num_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables, slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_list=qsl,
        seq_lens_list=seq_lens, max_query_len=max(q for _, q in specs), max_seq_len=max(seq_lens),
        block_size=block_size)


CASES = [
    # dtype, heads, kv heads, head dim, block size, [(context, query len)]
    (torch.float32, 9, 3, 64, 16, [(0, 1), (37, 1), (100, 1), (0, 20), (50, 13)]),
    (torch.float32, 8, 8, 128, 32, [(5, 1), (300, 1), (0, 7), (64, 33)]),
    (torch.float32, 4, 1, 80, 8, [(3, 1), (1000, 1), (17, 5)]),
    (torch.bfloat16, 9, 3, 64, 16, [(0, 1), (37, 1), (700, 1), (0, 20), (50, 13)]),
    (torch.float16, 6, 2, 96, 16, [(15, 1), (16, 1), (0, 3), (31, 2)]),
    # bf16 shapes the AVX-512 BF16 path takes (head_dim % 32, block_size % 16, group <= 8) and some it does not
    (torch.bfloat16, 8, 1, 128, 32, [(5, 1), (300, 1), (31, 1), (0, 7), (64, 33)]),
    (torch.bfloat16, 4, 4, 96, 16, [(15, 1), (16, 1), (17, 1), (0, 3), (31, 2)]),
    (torch.bfloat16, 16, 2, 32, 16, [(1, 1), (255, 1), (20, 4)]),
    (torch.bfloat16, 18, 2, 64, 16, [(40, 1), (3, 2)]),  # group of 9: generic loops
    (torch.bfloat16, 9, 3, 64, 8, [(40, 1), (77, 1), (3, 2)]),  # 8-token blocks: generic loops
]


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,block_size,specs", CASES)
def test_cpu_kernel_matches_torch_reference(dtype, heads, kv_heads, head_dim, block_size, specs):
    gen = torch.Generator().manual_seed(hash((heads, head_dim, block_size)) % 2**31)
    mc = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    cc = SimpleNamespace(block_size=block_size)
    ref, cpu = TorchAttentionBackend(mc, cc), CpuAttentionBackend(mc, cc)
    num_blocks = 160
    batch = _batch(specs, block_size, num_blocks, gen)
    cache = torch.randn(ref.kv_cache_shape(num_blocks), generator=gen).to(dtype)
    t = batch.num_tokens
    q = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    layer = SimpleNamespace(scale=head_dim ** -0.5)
    ref_cache, cpu_cache = cache.clone(), cache.clone()
    expected = ref.forward(layer, q, k, v, ref_cache, ref.build_metadata(batch))
    got = cpu.forward(layer, q, k, v, cpu_cache, cpu.build_metadata(batch))
    assert torch.equal(ref_cache, cpu_cache), "both backends must write the same K/V slots"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def _avx2_kernels():
    from isa_builds import build_at
    from pagoda.plugins.attention import cpu_backend

    return build_at("avx2", "pagoda_cpu_attention", cpu_backend._SOURCE, cpu_backend._header_flags())


# odd sizes for the AVX2 path: head_dim 8 * odd, blocks of 8, groups of 1 to 7, contexts off the tile of 8
AVX2_CASES = CASES[:5] + [
    (torch.bfloat16, 7, 1, 40, 8, [(1, 1), (13, 1), (250, 1), (0, 9), (33, 3)]),
    (torch.float16, 10, 2, 24, 24, [(7, 1), (47, 1), (0, 5), (19, 4)]),
    (torch.float32, 3, 3, 136, 16, [(1, 1), (129, 1), (2, 3)]),
]


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,block_size,specs", AVX2_CASES)
def test_the_avx2_path_matches_torch_reference(dtype, heads, kv_heads, head_dim, block_size, specs):
    kernels = _avx2_kernels()
    assert kernels.has_avx2_kernel() and not kernels.has_bf16_kernel()
    gen = torch.Generator().manual_seed(hash((heads, head_dim, block_size, 2)) % 2**31)
    mc = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    cc = SimpleNamespace(block_size=block_size)
    ref = TorchAttentionBackend(mc, cc)
    batch = _batch(specs, block_size, 160, gen)
    cache = torch.randn(ref.kv_cache_shape(160), generator=gen).to(dtype)
    t = batch.num_tokens
    q = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    layer = SimpleNamespace(scale=head_dim ** -0.5)
    ref_cache = cache.clone()  # the reference writes this step's K/V; the kernel then reads them in place
    expected = ref.forward(layer, q, k, v, ref_cache, ref.build_metadata(batch))
    # the kernel alone, on every token (decodes and prompts with cached context alike)
    q_lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
    token_req = torch.repeat_interleave(torch.arange(batch.num_reqs, dtype=torch.int32), q_lens)
    offset = torch.arange(t, dtype=torch.int32) - batch.query_start_loc[:-1][token_req.long()]
    token_len = ((batch.seq_lens - q_lens)[token_req.long()] + offset + 1).to(torch.int32)
    got = kernels.paged_attention(q, ref_cache, batch.block_tables, token_req, token_len, layer.scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.reshape(t, -1).float(), expected.float(), atol=tol, rtol=tol)


def test_the_avx2_path_reads_fp8_caches_as_the_reference_widens_them():
    from pagoda.plugins.attention.kv_fp8 import dequantize_fp8

    kernels = _avx2_kernels()
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, block_size = 6, 2, 72, 16
    batch = _batch([(3, 1), (70, 1), (200, 1)], block_size, 40, gen)
    cache = (torch.randn(2, kv_heads, 40, block_size, head_dim, generator=gen) * 50).to(torch.float8_e4m3fn)
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=gen).bfloat16()
    token_req = torch.arange(3, dtype=torch.int32)
    token_len = batch.seq_lens.to(torch.int32)
    got = kernels.paged_attention(q, cache, batch.block_tables, token_req, token_len, 0.1, 0.5, 2.0)
    widened = dequantize_fp8(cache, 1.0, torch.float32)
    expected = kernels.paged_attention(q.float(), widened, batch.block_tables, token_req, token_len, 0.1, 0.5, 2.0)
    # the same widened values in fp32 (checked against the reference above), one bf16 rounding apart
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_bf16_decodes_take_the_kernel_at_every_batch_size_on_the_default_model_shapes():
    torch.set_num_threads(1)
    from pagoda.plugins.attention.cpu_backend import MAX_KERNEL_DECODES

    mc = SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    cpu = CpuAttentionBackend(mc, SimpleNamespace(block_size=16))
    if not cpu.kernels.has_bf16_kernel():
        pytest.skip(f"the bf16 decode kernel needs AVX-512 BF16; this CPU runs {cpu_isa.describe()}")
    assert cpu.bf16_kernel
    batch = _batch([(30, 1)] * (MAX_KERNEL_DECODES + 5), 16, 200, torch.Generator().manual_seed(0))
    assert cpu.build_metadata(batch).torch_decode is None


def test_decodes_on_the_avx2_path_take_the_kernel_at_every_batch_size(monkeypatch):
    torch.set_num_threads(1)
    from pagoda.plugins.attention import cpu_backend

    monkeypatch.setattr(cpu_backend, "load_kernels", lambda host=None: _avx2_kernels())
    mc = SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    cpu = CpuAttentionBackend(mc, SimpleNamespace(block_size=16))
    assert cpu.isa_paths()["decode attention"] == "avx2"
    batch = _batch([(30, 1)] * (cpu_backend.MAX_KERNEL_DECODES + 5), 16, 200, torch.Generator().manual_seed(0))
    assert cpu.build_metadata(batch).torch_decode is None


def test_large_decode_batches_take_the_batched_path_on_one_thread_and_still_match():
    torch.set_num_threads(1)
    from pagoda.plugins.attention.cpu_backend import MAX_KERNEL_DECODES

    gen = torch.Generator().manual_seed(7)
    mc = SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    cc = SimpleNamespace(block_size=16)
    ref, cpu = TorchAttentionBackend(mc, cc), CpuAttentionBackend(mc, cc)
    cpu.decode_path = "generic"  # as on a CPU below AVX2 (the AVX2 path keeps every decode in the kernel)
    specs = [(int(n), 1) for n in torch.randint(0, 200, (MAX_KERNEL_DECODES + 3,), generator=gen)] + [(40, 9)]
    batch = _batch(specs, 16, 400, gen)
    md = cpu.build_metadata(batch)
    assert md.torch_decode is not None
    cache = torch.randn(ref.kv_cache_shape(400), generator=gen)
    q = torch.randn(batch.num_tokens, 9, 64, generator=gen)
    k = torch.randn(batch.num_tokens, 3, 64, generator=gen)
    v = torch.randn(batch.num_tokens, 3, 64, generator=gen)
    layer = SimpleNamespace(scale=0.125)
    expected = ref.forward(layer, q, k, v, cache.clone(), ref.build_metadata(batch))
    torch.testing.assert_close(cpu.forward(layer, q, k, v, cache.clone(), md), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, CpuAttentionBackend])
def test_a_padding_slot_of_minus_one_is_not_written(backend_cls):
    gen = torch.Generator().manual_seed(11)
    mc = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    backend = backend_cls(mc, SimpleNamespace(block_size=16))
    batch = _batch([(10, 1), (20, 1), (0, 5)], 16, 32, gen)
    batch.slot_mapping[1] = -1  # the second decode is padding this step
    cache = torch.randn(backend.kv_cache_shape(32), generator=gen)
    before = cache.clone()
    k = torch.randn(batch.num_tokens, 2, 64, generator=gen)
    q = torch.randn(batch.num_tokens, 4, 64, generator=gen)
    backend.forward(SimpleNamespace(scale=0.125), q, k, k, cache, backend.build_metadata(batch))
    changed = (cache != before).any(dim=-1).any(dim=1)[0].flatten()  # [num_blocks * block_size] slots of K
    written = set(changed.nonzero().flatten().tolist())
    expected = set(batch.slot_mapping[batch.slot_mapping >= 0].tolist())
    assert written == expected


def test_grouped_decodes_match_attention_computed_request_by_request():
    from pagoda.plugins.attention.torch_backend import DECODE_GROUP_SIZE

    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, d, bs = 6, 2, 32, 8
    mc = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, dtype=torch.float32)
    backend = TorchAttentionBackend(mc, SimpleNamespace(block_size=bs))
    contexts = torch.randint(0, 90, (2 * DECODE_GROUP_SIZE + 5,), generator=gen).tolist()
    batch = _batch([(c, 1) for c in contexts], bs, 600, gen)
    cache = torch.randn(backend.kv_cache_shape(600), generator=gen)
    q = torch.randn(batch.num_tokens, heads, d, generator=gen)
    k = torch.randn(batch.num_tokens, kv_heads, d, generator=gen)
    v = torch.randn(batch.num_tokens, kv_heads, d, generator=gen)
    out = backend.forward(SimpleNamespace(scale=d ** -0.5), q, k, v, cache, backend.build_metadata(batch))
    out = out.view(-1, heads, d)
    for i, ctx in enumerate(contexts):
        table = batch.block_tables[i].long()
        keys = cache[0][:, table].reshape(kv_heads, -1, d)[:, :ctx + 1]  # [Hkv, L, D]
        values = cache[1][:, table].reshape(kv_heads, -1, d)[:, :ctx + 1]
        keys = keys.repeat_interleave(heads // kv_heads, dim=0)
        values = values.repeat_interleave(heads // kv_heads, dim=0)
        weights = torch.softmax((keys @ q[i][:, :, None]).squeeze(-1) * d ** -0.5, dim=-1)  # [H, L]
        expected = (weights[:, :, None] * values).sum(1)
        torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_writes_strided_k_v_rows_into_the_same_slots_as_index_copy(dtype):
    from pagoda.plugins.attention.cpu_backend import load_kernels
    from pagoda.plugins.attention.torch_backend import write_kv

    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(37, 9 * 64 + 2 * 3 * 64, generator=gen).to(dtype)  # k, v are views with a row stride
    k, v = qkv[:, 576:768].view(37, 3, 64), qkv[:, 768:].view(37, 3, 64)
    slots = torch.randperm(20 * 16, generator=gen)[:37]
    expected, got = torch.zeros(2, 3, 20, 16, 64, dtype=dtype), torch.zeros(2, 3, 20, 16, 64, dtype=dtype)
    write_kv(expected, k, v, slots, None)
    load_kernels().write_kv(got, k, v, slots)
    assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="outside the cache"):
        load_kernels().write_kv(got, k[:1], v[:1], torch.tensor([20 * 16]))
