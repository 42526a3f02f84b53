"""The fused CPU kernels compute what the torch ops they replace compute."""

import pytest
import torch
import torch.nn.functional as F

from pagoda.host import cpu_isa
from pagoda.host.env import resolve_host_config
from pagoda.modeling.layers.fused_ops import CpuKernels, cpu_ops
from pagoda.modeling.layers.norm import RMSNorm
from pagoda.modeling.layers.rotary import RotaryEmbedding



@pytest.fixture(scope="module", autouse=True)
def ops():
    """The kernels, compiled when the first test here runs: not while pytest collects the file, so the test
    workers compile different kernels at the same time instead of one after the other."""
    built = cpu_ops()
    if built is None:
        pytest.skip("the fused CPU kernels could not be compiled here")
    return built


@pytest.fixture(scope="module")
def kernels(ops):
    return CpuKernels(resolve_host_config())  # as an engine with the environment's settings chooses them


SHAPES = [(1, 576), (7, 100), (64, 576), (300, 33)]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:  # one bf16 ulp where the fp32 sums differ in order (torch's own order depends on the CPU's ISA)
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
        assert int((a != b).sum()) <= max(2, a.numel() // 1000)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_add_rms_norm_matches_torch_add_then_rms_norm(dtype, rows, hidden, ops):
    g = torch.Generator().manual_seed(rows * hidden)
    x, res = (torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(hidden, generator=g).to(dtype)
    ref_res = x + res
    ref = F.rms_norm(ref_res, (hidden,), w, 1e-6)
    out = torch.empty_like(x)
    ops.add_rms_norm(x, res, w, 1e-6, out)
    assert torch.equal(res, ref_res)  # the residual sum is rounded exactly as torch rounds it
    _close(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_layer_gives_the_same_values_with_and_without_the_kernel(dtype, kernels):
    norm, plain = RMSNorm(96, 1e-5, dtype, kernels), RMSNorm(96, 1e-5, dtype)  # plain: torch ops
    for layer in (norm, plain):
        layer.weight.copy_(torch.linspace(0.5, 1.5, 96))
    x, res = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
    fused_y, fused_res = norm(x.clone(), res.clone())
    fused_plain = norm(x.clone())
    ref_y, ref_res = plain(x.clone(), res.clone())
    assert torch.equal(fused_res, ref_res)
    _close(fused_y, ref_y)
    _close(fused_plain, plain(x.clone()))


def test_rms_norm_without_residual_leaves_its_input_untouched(kernels):
    norm = RMSNorm(64, 1e-5, torch.bfloat16, kernels)
    x = torch.randn(3, 64).to(torch.bfloat16)
    before = x.clone()
    norm(x)
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (9, 50), (64, 1536), (3, 7)])
def test_silu_and_mul_matches_torch(dtype, rows, inter, kernels):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 6).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(kernels.silu_and_mul(gate_up), F.silu(gate) * up)


def test_silu_and_mul_reads_rows_of_a_wider_tensor(ops):
    wide = torch.randn(6, 80).to(torch.bfloat16)
    gate_up = wide[:, :64]  # row stride 80
    gate, up = gate_up.chunk(2, dim=-1)
    _close(ops.silu_and_mul(gate_up), F.silu(gate) * up)


def test_silu_and_mul_saturates_cleanly_at_extreme_inputs(ops):
    gate = torch.tensor([[-1e4, -100.0, -88.0, 0.0, 88.0, 100.0, 1e4, float("inf")]])
    out = ops.silu_and_mul(torch.cat([gate, torch.ones_like(gate)], dim=-1))
    _close(out, F.silu(gate))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim,tokens", [(9, 3, 64, 37), (4, 4, 32, 1), (2, 1, 128, 5)])
def test_rotary_rotates_q_and_k_in_place_as_the_torch_formula_does(dtype, heads, kv_heads, head_dim, tokens, kernels):
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype, kernels)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(tokens))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    cos, sin = rope.cos_sin(positions)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    ref_q = RotaryEmbedding.apply(q.reshape(tokens, heads, head_dim), cos, sin)
    ref_k = RotaryEmbedding.apply(k.reshape(tokens, kv_heads, head_dim), cos, sin)
    fused_q, fused_k, fused_v = rope.at(positions).split_qkv(qkv.clone(), heads, kv_heads, head_dim)
    assert torch.equal(fused_q, ref_q) and torch.equal(fused_k, ref_k)
    assert torch.equal(fused_v, v.reshape(tokens, kv_heads, head_dim))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (9, 50), (3, 7)])
def test_gelu_tanh_and_mul_matches_torch(dtype, rows, inter, kernels):
    g = torch.Generator().manual_seed(rows + inter + 1)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    _close(kernels.gelu_tanh_and_mul(gate_up), _gelu_tanh_and_mul_reference(gate_up))
    # torch's own op: the same up to its float32 tanh, whose 1 + tanh(u) cancels for large negative inputs
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.gelu_tanh_and_mul(gate_up).float(),
                               (F.gelu(gate, approximate="tanh") * up).float(), rtol=1e-2, atol=1e-2)


def _gelu_tanh(x):
    """0.5 x (1 + tanh(u)) as x * sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3): equal, without the
    cancellation of 1 + tanh(u) that zeroes the far negative tail even in float64."""
    return x * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3))


def _gelu_tanh_and_mul_reference(gate_up):
    """The formula in float64, rounded where torch's ops store: the GELU in the dtype, then its product."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return (_gelu_tanh(gate).to(gate_up.dtype).double() * up).to(gate_up.dtype)


def test_gelu_tanh_and_mul_reads_strided_rows_and_saturates_cleanly(ops):
    wide = torch.randn(6, 80).to(torch.bfloat16)
    _close(ops.gelu_tanh_and_mul(wide[:, :64]), _gelu_tanh_and_mul_reference(wide[:, :64]))  # row stride 80
    extreme = torch.tensor([[-1e4, -100.0, -10.0, -3.0, 0.0, 1e-3, 3.0, 10.0, 100.0, 1e4]])
    got = ops.gelu_tanh_and_mul(torch.cat([extreme, torch.ones_like(extreme)], dim=-1))
    _close(got, _gelu_tanh(extreme.double()).float())


def _unfused_qk_norm_rotary(qkv, q_weight, k_weight, eps, heads, kv_heads, head_dim, rope, positions, kernels):
    """What a layer with per-head q/k norms computes without the fused kernel: the RMSNorm layer on each q and k
    head, then the torch rotary formula."""
    tokens = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    out = []
    for part, weight, n in ((q, q_weight, heads), (k, k_weight, kv_heads)):
        norm = RMSNorm(head_dim, eps, qkv.dtype, kernels)
        norm.weight.data.copy_(weight)
        normed = norm(part.reshape(-1, head_dim).contiguous()).view(tokens, n, head_dim)  # (the kernel path)
        if rope is not None:
            cos, sin = rope.cos_sin(positions)
            normed = RotaryEmbedding.apply(normed, cos, sin)
        out.append(normed)
    return out[0], out[1], v.reshape(tokens, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim,tokens,rotate", [
    (9, 3, 64, 37, True), (4, 4, 256, 1, True), (2, 1, 80, 5, True), (6, 2, 22, 3, True), (3, 1, 64, 4, False)])
def test_qk_norm_rotary_gives_the_bits_of_the_norm_kernel_then_rope(dtype, heads, kv_heads, head_dim, tokens, rotate,
                                                                     kernels):
    g = torch.Generator().manual_seed(heads * head_dim + tokens)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype, kernels) if rotate else None
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    qkv = (3 * torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)).to(dtype)
    q_weight, k_weight = (1 + torch.randn(head_dim, generator=g)).to(dtype), torch.randn(head_dim, generator=g).to(dtype)
    ref = _unfused_qk_norm_rotary(qkv, q_weight, k_weight, 1e-6, heads, kv_heads, head_dim, rope, positions, kernels)
    rows = qkv.clone()
    tables = rope.at(positions).kernel_tables() if rotate else None
    assert kernels.qk_norm_rotary_(rows, q_weight, k_weight, 1e-6, heads, kv_heads, head_dim, tables)
    got_q, got_k, got_v = rows.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    assert torch.equal(got_q.reshape(tokens, heads, head_dim), ref[0])
    assert torch.equal(got_k.reshape(tokens, kv_heads, head_dim), ref[1])
    assert torch.equal(got_v.reshape(tokens, kv_heads, head_dim), ref[2])
    # and the values of torch's own RMSNorm in float32
    qf = F.rms_norm(qkv[:, :heads * head_dim].float().view(tokens, heads, head_dim), (head_dim,), q_weight.float(),
                    1e-6)
    if rotate:
        cos, sin = rope.cos_sin(positions)
        qf = RotaryEmbedding.apply(qf, cos.float(), sin.float())
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: the normed q is stored before it is rotated
    torch.testing.assert_close(got_q.reshape(tokens, heads, head_dim).float(), qf, rtol=tol, atol=tol)


def test_qk_norm_rotary_leaves_unsupported_tensors_to_the_torch_path(kernels):
    qkv = torch.randn(2, 5 * 64).to(torch.float64)
    assert not kernels.qk_norm_rotary_(qkv, torch.ones(64, dtype=torch.float64), torch.ones(64, dtype=torch.float64),
                                       1e-6, 3, 1, 64, None)


def test_kernels_refuse_tensors_they_cannot_read(ops):
    with pytest.raises(RuntimeError, match="weight must be"):
        x = torch.randn(2, 8)
        ops.add_rms_norm(x, None, torch.ones(4), 1e-5, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="positions must be int64"):
        ops.rotary_(torch.randn(2, 128), torch.ones(10, 64), torch.ones(10, 64), torch.zeros(2, dtype=torch.int32),
                    1, 64)
    with pytest.raises(RuntimeError, match="q_weight and k_weight must be"):
        ops.qk_norm_rotary_(torch.randn(2, 5 * 64), torch.ones(32), torch.ones(64), 1e-6, 3, 1, 64)
    with pytest.raises(RuntimeError, match="exceed the qkv width"):
        ops.qk_norm_rotary_(torch.randn(2, 3 * 64), torch.ones(64), torch.ones(64), 1e-6, 3, 1, 64)


@pytest.fixture
def gemv(ops):
    if not ops.has_bf16_gemv():
        pytest.skip(f"the bf16 GEMV needs AVX2 at least; this CPU runs {cpu_isa.describe()}")
    return ops.gemv_bf16


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_features,in_features", [(7, 100), (13, 576), (96, 33), (1728, 576), (5, 1536)])
def test_bf16_gemv_matches_an_fp32_matmul_of_the_same_values(rows, out_features, in_features, gemv):
    g = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    ref = F.linear(x.float(), w.float(), b.float())
    for bias, expected in ((b, ref), (None, ref - b.float())):
        y = gemv(x, w, bias)
        # fp32 sums in another order, then one bf16 rounding
        torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def test_linear_takes_the_gemv_for_a_few_rows_and_torch_beyond(ops):
    from pagoda.modeling.layers import fused_ops

    if ops.gemv_path() != "avx512_bf16":
        pytest.skip(f"the AVX-512 BF16 GEMV; this CPU runs {cpu_isa.describe()} (AVX2: the tests of its build below)")

    calls = []

    class CountingOps:
        def gemv_bf16(self, *args):
            calls.append(1)
            return ops.gemv_bf16(*args)

    counting = CpuKernels(resolve_host_config())
    assert counting.gemv_path == "avx512_bf16"
    counting.ops = CountingOps()
    w = torch.randn(64, 48).bfloat16()
    x3 = torch.randn(1, 2, 48).bfloat16()  # leading dims are flattened
    y = counting.linear(x3, w)
    assert calls and y.shape == (1, 2, 64)
    torch.testing.assert_close(y.float(), F.linear(x3.float(), w.float()), rtol=1e-2, atol=5e-2)
    calls.clear()
    counting.linear(torch.randn(fused_ops.GEMV_MAX_ROWS + 1, 48).bfloat16(), w)
    counting.linear(torch.randn(2, 48), w.float())  # fp32 stays on torch
    assert not calls


def _avx2_ops():
    from isa_builds import build_at
    from pagoda.modeling.layers import fused_ops

    return build_at("avx2", "pagoda_cpu_ops", fused_ops._SOURCE, ["-ffp-contract=off"])


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 40])
@pytest.mark.parametrize("out_features,in_features", [(7, 100), (13, 577), (96, 33), (1728, 576), (5, 3)])
def test_avx2_gemv_and_tiled_gemm_match_an_fp32_matmul_of_the_same_values(rows, out_features, in_features):
    avx2 = _avx2_ops()
    assert avx2.gemv_path() == "avx2"
    g = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    ref = F.linear(x.float(), w.float(), b.float())
    for bias, expected in ((b, ref), (None, ref - b.float())):
        # the row-blocked GEMM in blocks of 4 rows and chunks of 5 weight rows: ragged last block and chunk
        for y in (avx2.gemv_bf16(x, w, bias), avx2.gemm_bf16_fp32(x, w, bias, 64),
                  avx2.gemm_bf16_fp32_rows(x, w, bias, 4, 5), avx2.gemm_bf16_fp32_rows(x, w, bias)):
            # fp32 sums of exact products in another order, then one bf16 rounding
            assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
            torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("out_features,in_features", [(13, 67), (7, 3), (96, 40)])
def test_avx2_gemv_gives_each_row_the_bits_it_gets_alone_at_every_row_count(out_features, in_features):
    """The GEMV blocks 4, 2 or 1 rows at a time, and each output is the same sum whatever the block, so a row's
    bits do not depend on the rows around it."""
    avx2 = _avx2_ops()
    g = torch.Generator().manual_seed(out_features + in_features)
    x = torch.randn(300, in_features, generator=g).bfloat16()
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    alone = torch.cat([avx2.gemv_bf16(x[i:i + 1], w, b) for i in range(300)])
    torch.testing.assert_close(alone.float(), F.linear(x.float(), w.float(), b.float()), rtol=1e-2,
                               atol=1e-2 * alone.float().abs().max().item())
    for rows in (2, 3, 5, 17, 300):
        for start in (0, 1):
            assert torch.equal(avx2.gemv_bf16(x[start:start + rows], w, b), alone[start:start + rows]), rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_avx2_build_of_the_elementwise_kernels_matches_torch(dtype):
    avx2 = _avx2_ops()
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(7, 100, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(100, generator=g).to(dtype)
    ref_res = x + res
    out = torch.empty_like(x)
    avx2.add_rms_norm(x, res, w, 1e-6, out)
    assert torch.equal(res, ref_res)
    _close(out, F.rms_norm(ref_res, (100,), w, 1e-6))
    gate_up = (torch.randn(9, 2 * 50, generator=g) * 6).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(avx2.silu_and_mul(gate_up), F.silu(gate) * up)
    extreme = torch.tensor([[-1e4, -100.0, -88.0, 0.0, 88.0, 100.0, 1e4, float("inf"), 3.0]]).to(dtype)
    _close(avx2.silu_and_mul(torch.cat([extreme, torch.ones_like(extreme)], dim=-1)), F.silu(extreme))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,tokens", [(9, 3, 64, 37), (3, 1, 40, 5), (2, 2, 22, 3)])
def test_avx2_build_of_rotary_rotates_exactly_as_the_torch_formula_does(dtype, heads, kv_heads, head_dim, tokens):
    avx2 = _avx2_ops()
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(tokens))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    cos, sin = rope.cos_sin(positions)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    ref_q = RotaryEmbedding.apply(q.reshape(tokens, heads, head_dim), cos, sin)
    ref_k = RotaryEmbedding.apply(k.reshape(tokens, kv_heads, head_dim), cos, sin)
    rows = qkv.clone()
    avx2.rotary_(rows, rope.cos_cache, rope.sin_cache, positions, heads + kv_heads, head_dim)
    got_q, got_k, _ = rows.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    assert torch.equal(got_q.reshape(tokens, heads, head_dim), ref_q)
    assert torch.equal(got_k.reshape(tokens, kv_heads, head_dim), ref_k)


def test_row_blocked_gemm_rounds_as_bf16_of_the_fp32_sum_plus_bias_and_keeps_special_values():
    """The row-blocked GEMM's output is the fp32 product plus the bias rounded once to bf16 (the vector and the
    scalar tail of its store agree), and an inf or NaN input comes out as torch's does."""
    avx2 = _avx2_ops()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(37, 19, generator=g).bfloat16()
    w = torch.randn(21, 19, generator=g).bfloat16()
    b = torch.randn(21, generator=g).bfloat16()
    x[3, 2], x[5, 7] = float("inf"), float("nan")
    y = avx2.gemm_bf16_fp32_rows(x, w, b, 8, 16)
    ref = F.linear(x.float(), w.float(), b.float())
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(y.float())) and torch.equal(ref.isnan(), y.float().isnan())
    torch.testing.assert_close(y.float()[finite], ref[finite].bfloat16().float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(RuntimeError, match="row_block and chunk_rows must be positive"):
        avx2.gemm_bf16_fp32_rows(x, w, b, 0, 16)


def test_linear_on_an_avx2_build_takes_the_gemv_then_the_tiled_gemm():
    from pagoda.modeling.layers import fused_ops

    avx2 = _avx2_ops()
    calls = []

    class CountingOps:
        def gemv_bf16(self, *args):
            calls.append("gemv")
            return avx2.gemv_bf16(*args)

        def gemm_bf16_fp32(self, *args):
            calls.append("gemm")
            return avx2.gemm_bf16_fp32(*args)

        def gemm_bf16_fp32_rows(self, *args):
            calls.append("rows")
            return avx2.gemm_bf16_fp32_rows(*args)

    counting = CpuKernels()
    counting.ops, counting.gemv_path = CountingOps(), "avx2"
    w = torch.randn(64, 48).bfloat16()
    for rows in (1, fused_ops.AVX2_GEMV_MAX_ROWS, fused_ops.AVX2_GEMV_MAX_ROWS + 1):
        x = torch.randn(rows, 48).bfloat16()
        torch.testing.assert_close(counting.linear(x, w).float(), F.linear(x.float(), w.float()), rtol=1e-2,
                                   atol=5e-2)
    assert calls == ["gemv", "gemv", "gemm"]
    calls.clear()
    x = torch.randn(fused_ops.AVX2_ROWS_GEMM_MIN_ROWS + 3, 48).bfloat16()  # a prefill chunk
    torch.testing.assert_close(counting.linear(x, w).float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=5e-2)
    assert calls == ["rows"]
    calls.clear()
    with torch.inference_mode():  # as the engine runs it: the GEMMs' worker threads write inference tensors
        for rows in (40, fused_ops.AVX2_ROWS_GEMM_MIN_ROWS):
            x = torch.randn(rows, 48).bfloat16()
            torch.testing.assert_close(counting.linear(x, w).float(), F.linear(x.float(), w.float()), rtol=1e-2,
                                       atol=5e-2)
    assert calls == ["gemm", "rows"]
