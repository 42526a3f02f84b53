"""The fresh-prompt kernel (``cpu_prefill.cpp``) against causal attention computed in float32."""

import pytest
import torch
import torch.nn.functional as F

from pagoda.host import cpu_isa
from pagoda.plugins.attention.cpu_backend import load_prefill_kernel

# on a CPU with AVX2 or more a kernel that fails to build is a failure, not a skip
pytestmark = pytest.mark.skipif(cpu_isa.cpu_isa() == "generic",
                                reason=f"the prefill kernel needs AVX2 at least; this CPU runs {cpu_isa.describe()}")


@pytest.fixture(scope="module")
def kernel():
    """The build an engine loads, compiled when a test first asks for it (not while pytest collects the file, so
    the test workers compile different kernels at the same time)."""
    return load_prefill_kernel()


def test_the_kernel_builds_on_this_cpu(kernel):
    assert kernel is not None and kernel.supports_head_dim(64)


def _qkv(tokens, heads, kv_heads, head_dim, gen):
    """q, k, v as views of one fused projection output, as the model hands them over."""
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(torch.bfloat16)
    q = fused[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = fused[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = fused[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    return q, k, v


def _reference(q, k, v, ranges, scale):
    out = {}
    group = q.shape[1] // k.shape[1]
    for start, end in ranges:
        qi, ki, vi = (t[start:end].float().transpose(0, 1) for t in (q, k, v))
        ki, vi = ki.repeat_interleave(group, 0), vi.repeat_interleave(group, 0)
        out[(start, end)] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale).transpose(0, 1)
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim,lengths", [
    (9, 3, 64, [1, 15, 16, 17, 100, 300]),  # the default model's shapes; block edges
    (8, 8, 128, [7, 40, 33]),
    (16, 2, 32, [31, 64, 3]),
    (4, 1, 64, [129]),
])
def test_prompts_match_float32_causal_attention(heads, kv_heads, head_dim, lengths, kernel):
    gen = torch.Generator().manual_seed(sum(lengths) + head_dim)
    ranges, start = [], 0
    for n in lengths:
        ranges.append((start, start + n))
        start += n
    q, k, v = _qkv(start, heads, kv_heads, head_dim, gen)
    out = torch.zeros(start, heads, head_dim, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    kernel.prefill_attention(q, k, v, out, [i for r in ranges for i in r], scale)
    for (s, e), ref in _reference(q, k, v, ranges, scale).items():
        # probabilities are rounded to bf16 before P.V, as in bf16 GEMM attention: a few bf16 ulps
        torch.testing.assert_close(out[s:e].float(), ref, atol=2e-2, rtol=2e-2)
        assert (out[s:e].float() - ref).abs().mean() < 2e-3


def test_tokens_outside_the_ranges_are_left_alone_and_ranges_need_not_touch(kernel):
    gen = torch.Generator().manual_seed(7)
    q, k, v = _qkv(60, 9, 3, 64, gen)
    out = torch.full((60, 9, 64), 5.0, dtype=torch.bfloat16)
    ranges = [(3, 20), (30, 31), (40, 58)]  # decodes or cached-context chunks would sit in the gaps
    kernel.prefill_attention(q, k, v, out, [i for r in ranges for i in r], 0.125)
    inside = torch.zeros(60, dtype=torch.bool)
    for s, e in ranges:
        inside[s:e] = True
    assert (out[~inside] == 5.0).all()
    for (s, e), ref in _reference(q, k, v, ranges, 0.125).items():
        torch.testing.assert_close(out[s:e].float(), ref, atol=2e-2, rtol=2e-2)
    # a prompt sees only itself: its first token's output is its own value row, per head
    torch.testing.assert_close(out[30].float(), v[30].float().repeat_interleave(3, 0), atol=1e-2, rtol=1e-2)


def test_k_and_v_may_have_different_token_strides(kernel):
    gen = torch.Generator().manual_seed(11)
    q, k, _ = _qkv(40, 9, 3, 64, gen)
    v = torch.randn(40, 3, 64, generator=gen).to(torch.bfloat16)  # its own contiguous tensor
    out = torch.empty(40, 9, 64, dtype=torch.bfloat16)
    kernel.prefill_attention(q, k, v, out, [0, 40], 0.125)
    torch.testing.assert_close(out.float(), _reference(q, k, v, [(0, 40)], 0.125)[(0, 40)], atol=2e-2, rtol=2e-2)


def test_bad_arguments_are_refused_with_what_was_wrong(kernel):
    gen = torch.Generator().manual_seed(3)
    q, k, v = _qkv(10, 9, 3, 64, gen)
    out = torch.empty(10, 9, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="range out of bounds"):
        kernel.prefill_attention(q, k, v, out, [0, 11], 0.125)
    with pytest.raises(RuntimeError, match="share one dtype"):
        kernel.prefill_attention(q.float(), k, v, out, [0, 10], 0.125)
    with pytest.raises(RuntimeError, match="no kernel for head_dim 48"):
        q48, k48, v48 = _qkv(4, 2, 1, 48, gen)
        kernel.prefill_attention(q48, k48, v48, torch.empty(4, 2, 48, dtype=torch.bfloat16), [0, 4], 0.1)


def _avx2_kernel():
    from isa_builds import build_at
    from pagoda.plugins.attention import cpu_backend

    return build_at("avx2", "pagoda_cpu_prefill", cpu_backend._PREFILL_SOURCE, cpu_backend._header_flags())


def _kernel_for(kernel, dtype):
    """This CPU's kernel where its build takes ``dtype``; else the AVX2 build, which takes every 16-bit dtype (the
    AVX-512 BF16 build takes bf16 only)."""
    name = str(dtype).removeprefix("torch.")
    return kernel if dtype == torch.bfloat16 or kernel.supports_dtype(name) else _avx2_kernel()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim,lengths", [
    (9, 3, 64, [1, 15, 16, 17, 100, 300]),
    (8, 8, 128, [7, 40, 33]),
    (7, 1, 32, [31, 3, 49]),
])
def test_the_avx2_path_matches_float32_causal_attention(dtype, heads, kv_heads, head_dim, lengths):
    avx2 = _avx2_kernel()
    assert avx2.isa_path() == "avx2" and avx2.supports_dtype("float16") and avx2.supports_head_dim(head_dim)
    assert not avx2.supports_dtype("float32")  # fp32 models keep SDPA, though the kernel computes fp32 prompts too
    gen = torch.Generator().manual_seed(sum(lengths) + head_dim + 1)
    ranges, start = [], 0
    for n in lengths:
        ranges.append((start, start + n))
        start += n
    q, k, v = (t.to(dtype) for t in _qkv(start, heads, kv_heads, head_dim, gen))
    out = torch.zeros(start, heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    avx2.prefill_attention(q, k, v, out, [i for r in ranges for i in r], scale)
    for (s, e), ref in _reference(q, k, v, ranges, scale).items():
        # fp32 throughout: one rounding to the dtype (fp32: the exp polynomial's ~1e-7)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[s:e].float(), ref, atol=tol, rtol=tol)


def _shaped_reference(q, k, v, ranges, scale, window, softcap, sinks):
    """Each prompt's attention written out in float32 as transformers' eager path computes it: causal, within
    ``window`` of each token, scores soft-capped, each head's sink logit in its softmax's denominator."""
    out = {}
    group = q.shape[1] // k.shape[1]
    for start, end in ranges:
        qi, ki, vi = (t[start:end].float().transpose(0, 1) for t in (q, k, v))
        ki, vi = ki.repeat_interleave(group, 0), vi.repeat_interleave(group, 0)
        scores = qi @ ki.transpose(1, 2) * scale  # [H, n, n]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(end - start)
        allowed = pos[None, :] <= pos[:, None]
        if window:
            allowed &= pos[None, :] > pos[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            both = torch.cat((scores, sinks.view(-1, 1, 1).expand(-1, end - start, 1)), dim=-1)
            probs = torch.softmax(both, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[(start, end)] = (probs @ vi).transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,lengths,window,softcap,sinks", [
    (9, 3, 64, [1, 15, 16, 17, 100, 200], 33, 50.0, True),  # gpt-oss-like: window and sinks, plus a cap
    (8, 4, 256, [40, 19], None, 50.0, False),  # Gemma 2: soft-cap, head_dim 256
    (8, 4, 256, [70, 3], 16, 50.0, False),  # Gemma 2's window layers, a window of one block
    (6, 2, 80, [33, 50], 7, None, True),  # a window shorter than a block: rows see part of a block only
    (12, 4, 96, [45, 8], 200, 30.0, False),  # a window longer than the prompts: the cap alone
    (4, 1, 128, [129], None, None, True),  # sinks alone
    (4, 4, 64, [90, 31], 1, None, False),  # each token sees itself only
])
def test_windowed_soft_capped_and_sink_prompts_match_float32_attention(dtype, heads, kv_heads, head_dim, lengths,
                                                                       window, softcap, sinks, kernel):
    kernel = _kernel_for(kernel, dtype)
    gen = torch.Generator().manual_seed(sum(lengths) + head_dim + (window or 0))
    ranges, start = [], 0
    for n in lengths:
        ranges.append((start, start + n))
        start += n
    q, k, v = (t.to(dtype) for t in _qkv(start, heads, kv_heads, head_dim, gen))
    q = q * 3  # large scores: the soft-cap bites
    sink_logits = 2 * torch.randn(heads, generator=gen) if sinks else None
    out = torch.zeros(start, heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    kernel.prefill_attention(q, k, v, out, [i for r in ranges for i in r], scale, window=window or 0,
                             softcap=softcap or 0.0, sinks=sink_logits)
    for (s, e), ref in _shaped_reference(q, k, v, ranges, scale, window, softcap, sink_logits).items():
        torch.testing.assert_close(out[s:e].float(), ref, atol=2e-2, rtol=2e-2)
        assert (out[s:e].float() - ref).abs().mean() < 2e-3


def test_a_window_cuts_exactly_the_keys_before_it(kernel):
    """With a window of 5, token 40's output is plain attention over tokens 36-40 alone."""
    kernel = _kernel_for(kernel, torch.float16)
    gen = torch.Generator().manual_seed(21)
    q, k, v = (t.to(torch.float16) for t in _qkv(48, 2, 1, 64, gen))
    out = torch.zeros(48, 2, 64, dtype=torch.float16)
    kernel.prefill_attention(q, k, v, out, [0, 48], 0.125, window=5)
    probs = torch.softmax(q[40].float() @ k[36:41, 0].float().T * 0.125, dim=-1)
    torch.testing.assert_close(out[40].float(), probs @ v[36:41, 0].float(), atol=2e-3, rtol=2e-3)


def test_shaped_prompts_after_cached_rows_are_the_bits_of_the_whole_prompt(kernel):
    """``query_from`` with a window, soft-cap and sinks: the rows computed are the same bits as in the whole
    prompt's call (a prefix-cache hit gives the cold prefill's outputs)."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = _qkv(70, 9, 3, 64, gen)
    sinks = torch.randn(9, generator=gen)
    shape = dict(window=20, softcap=30.0, sinks=sinks)
    whole, part = torch.zeros(70, 9, 64, dtype=torch.bfloat16), torch.zeros(70, 9, 64, dtype=torch.bfloat16)
    kernel.prefill_attention(q, k, v, whole, [0, 70], 0.125, **shape)
    kernel.prefill_attention(q, k, v, part, [0, 70], 0.125, [37], **shape)
    assert torch.equal(whole[37:], part[37:])


def test_bad_shapes_are_refused_with_what_was_wrong(kernel):
    gen = torch.Generator().manual_seed(4)
    q, k, v = _qkv(10, 4, 2, 64, gen)
    out = torch.empty(10, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="one value per query head"):
        kernel.prefill_attention(q, k, v, out, [0, 10], 0.125, sinks=torch.zeros(3))
    with pytest.raises(RuntimeError, match="window must be 0"):
        kernel.prefill_attention(q, k, v, out, [0, 10], 0.125, window=-1)
    with pytest.raises(RuntimeError, match="softcap must be 0"):
        kernel.prefill_attention(q, k, v, out, [0, 10], 0.125, softcap=-2.0)
