"""The ``cpu`` backend on layers with a sliding window, a logit soft-cap or attention sinks (Gemma 2/3, gpt-oss,
Mistral), against the ``torch`` reference backend: decodes and prompt tokens after cached context go through
the C++ paged kernel, which skips the blocks before each token's window and masks the rest."""

from types import SimpleNamespace

import pytest
import torch

from pagoda.plugins.attention.cpu_backend import CpuAttentionBackend
from pagoda.plugins.attention.torch_backend import TorchAttentionBackend
from test_cpu_attention import _batch

def _float32_reference(ref, layer, q, k, v, cache, batch):
    """The torch backend's (built for float32) answer in float32 on the same (rounded) inputs: the kernels compute in float32 and round
    once, where the torch backend in bf16 rounds its probabilities too (a few outputs differ by its rounding)."""
    layer32 = SimpleNamespace(scale=layer.scale, sliding_window=layer.sliding_window,
                              logit_softcap=layer.logit_softcap,
                              sinks=None if layer.sinks is None else layer.sinks.float())
    return ref.forward(layer32, q.float(), k.float(), v.float(), cache, ref.build_metadata(batch))


CASES = [
    # dtype, heads, kv heads, head dim, block size, [(context, query len)], window, soft-cap, sinks
    (torch.float32, 9, 3, 64, 16, [(0, 1), (37, 1), (100, 1), (0, 40), (50, 13)], 24, None, False),
    (torch.float32, 9, 3, 64, 16, [(5, 1), (300, 1), (0, 20), (64, 3)], 33, 50.0, True),
    (torch.float32, 4, 1, 80, 8, [(3, 1), (200, 1), (17, 5)], 7, None, True),
    (torch.float32, 8, 2, 64, 16, [(9, 1), (130, 1), (0, 9)], None, 30.0, False),  # soft-cap alone
    (torch.float32, 8, 2, 64, 16, [(9, 1), (130, 1), (0, 9)], None, None, True),  # sinks alone
    (torch.float32, 8, 2, 64, 16, [(9, 1), (50, 1), (0, 9)], 512, None, False),  # a window no sequence reaches
    (torch.bfloat16, 9, 3, 64, 16, [(0, 1), (37, 1), (401, 1), (0, 20), (50, 13)], 128, None, True),
    (torch.bfloat16, 18, 2, 64, 16, [(40, 1), (3, 2)], 17, 20.0, True),  # group of 9: the generic loops
    (torch.float16, 10, 2, 24, 24, [(7, 1), (47, 1), (0, 5), (19, 4)], 11, 10.0, True),
]


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,block_size,specs,window,softcap,sinks", CASES)
def test_windowed_soft_capped_and_sink_layers_match_the_torch_reference(dtype, heads, kv_heads, head_dim,
                                                                         block_size, specs, window, softcap, sinks):
    gen = torch.Generator().manual_seed(hash((heads, head_dim, block_size, window)) % 2**31)
    mc = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    cc = SimpleNamespace(block_size=block_size)
    ref = TorchAttentionBackend(SimpleNamespace(**{**vars(mc), "dtype": torch.float32}), cc)
    cpu = CpuAttentionBackend(mc, cc)
    batch = _batch(specs, block_size, 160, gen)
    cache = torch.randn(ref.kv_cache_shape(160), generator=gen).to(dtype)
    t = batch.num_tokens
    q = (3 * torch.randn(t, heads, head_dim, generator=gen)).to(dtype)  # large scores: the soft-cap bites
    k = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    layer = SimpleNamespace(scale=head_dim ** -0.5, sliding_window=window, logit_softcap=softcap,
                            sinks=(2 * torch.randn(heads, generator=gen)).to(dtype) if sinks else None)
    ref_cache, cpu_cache = cache.float(), cache.clone()
    expected = _float32_reference(ref, layer, q, k, v, ref_cache, batch)
    md = cpu.build_metadata(batch)
    got = cpu.forward(layer, q, k, v, cpu_cache, md)
    assert md.torch_all is None, "the layer must take the kernel, not the torch backend's path"
    assert torch.equal(ref_cache.to(dtype), cpu_cache), "both backends must write the same K/V slots"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_the_kernel_window_hides_exactly_the_keys_before_it():
    """One decode over 40 keys with a window of 5 equals plain attention over its last 5 keys alone."""
    gen = torch.Generator().manual_seed(5)
    mc = SimpleNamespace(num_heads=2, num_kv_heads=1, head_dim=64, dtype=torch.float32)
    cpu = CpuAttentionBackend(mc, SimpleNamespace(block_size=16))
    cache = torch.randn(cpu.kv_cache_shape(4), generator=gen)
    q = torch.randn(1, 2, 64, generator=gen)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    one = torch.zeros(1, dtype=torch.int32)
    got = cpu.kernels.paged_attention(q, cache, table, one, torch.tensor([40], dtype=torch.int32), 0.125, window=5)
    keys = cache.view(2, 1, 64, 64)[:, 0, list(range(3 * 16 + 3, 3 * 16 + 8))]  # positions 35-39: block 3
    probs = torch.softmax(q[0] @ keys[0].T * 0.125, dim=-1)
    torch.testing.assert_close(got[0], probs @ keys[1], atol=1e-5, rtol=1e-5)


PROMPT_CASES = [
    # dtype, heads, kv heads, head dim, block size, [(context, query len)], window, soft-cap, sinks
    (torch.bfloat16, 9, 3, 64, 16, [(30, 1), (0, 40), (50, 13), (0, 150)], 128, 50.0, True),  # gpt-oss-like
    (torch.bfloat16, 8, 4, 256, 16, [(9, 1), (0, 33), (20, 17)], 16, 50.0, False),  # Gemma 2 / 3
    (torch.float16, 6, 2, 80, 16, [(0, 45), (37, 9)], 7, None, True),
    (torch.bfloat16, 12, 4, 96, 16, [(0, 21), (3, 30)], None, 30.0, False),
]


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,block_size,specs,window,softcap,sinks", PROMPT_CASES)
def test_prompts_of_shaped_layers_take_the_prefill_kernel_and_match_the_torch_reference(
        dtype, heads, kv_heads, head_dim, block_size, specs, window, softcap, sinks, monkeypatch):
    """Fresh prompts and prompt tokens after cached context (a prefix-cache hit, a later chunk) of a windowed,
    soft-capped or sink layer go through the prefill kernel, never the torch backend's masked attention."""
    gen = torch.Generator().manual_seed(hash((heads, head_dim, window, softcap)) % 2**31)
    probe = CpuAttentionBackend(SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                                dtype=torch.bfloat16), SimpleNamespace(block_size=block_size))
    if not probe.prefill_kernel.supports_dtype(str(dtype).removeprefix("torch.")):
        dtype = torch.bfloat16  # the AVX-512 BF16 build takes bf16 prompts only: the same shapes in bf16
    mc = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    cc = SimpleNamespace(block_size=block_size)
    ref = TorchAttentionBackend(SimpleNamespace(**{**vars(mc), "dtype": torch.float32}), cc)
    cpu = CpuAttentionBackend(mc, cc)
    assert cpu.prefill_kernel is not None, "this CPU builds the prefill kernel for these shapes"
    batch = _batch(specs, block_size, 160, gen)
    batch.prompt_lens_list = batch.seq_lens_list  # every request is still in its prompt
    cache = torch.randn(ref.kv_cache_shape(160), generator=gen).to(dtype)
    t = batch.num_tokens
    q = (3 * torch.randn(t, heads, head_dim, generator=gen)).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    layer = SimpleNamespace(scale=head_dim ** -0.5, sliding_window=window, logit_softcap=softcap,
                            sinks=(2 * torch.randn(heads, generator=gen)).to(dtype) if sinks else None)
    ref_cache, cpu_cache = cache.float(), cache.clone()
    expected = _float32_reference(ref, layer, q, k, v, ref_cache, batch)

    def refuse(*args, **kwargs):
        raise AssertionError("a prompt of this layer went through the torch backend's masked attention")

    monkeypatch.setattr(cpu, "_attend_fresh", refuse)
    md = cpu.build_metadata(batch)
    got = cpu.forward(layer, q, k, v, cpu_cache, md)
    assert md.torch_all is None and md.context_prefills is not None and md.fresh_prefills
    assert torch.equal(ref_cache.to(dtype), cpu_cache)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
