// Fused elementwise ops of the decoder layer for x86 CPUs: one pass over memory where the
// unfused torch ops take two to four, and no temporaries.
//
// Every op rounds to the tensor dtype exactly where the torch ops it replaces do, so a bf16
// model computes the same values either way (up to the order of the RMS sum and a 1-ulp fp32 exp; the
// GELU's far negative tail, which torch's 1 + tanh(u) rounds to zero, keeps its tiny true values).

#include "pagoda_torch.h"
#include "pagoda_float.h"
#include "pagoda_vec8.h"
#include "pagoda_bf16_dot.h"
#include <ATen/ThreadLocalState.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using pagoda::from_f;
using pagoda::round_to;
using pagoda::to_f;

// Runs fn(begin, end) over [0, total) in chunks of `chunk` that the threads take one at a time as they finish
// the last. A static split makes every thread wait at the end for one the OS held up (a server's event loop,
// tokenizer or another process ran on its core); here that thread takes fewer chunks instead.
template <typename F>
void parallel_chunks(int64_t total, int64_t chunk, const F& fn) {
  const int64_t num_chunks = (total + chunk - 1) / chunk;
  if (num_chunks <= 1 || at::get_num_threads() == 1 || at::in_parallel_region()) {
    fn(int64_t{0}, total);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c = next++; c < num_chunks; c = next++) fn(c * chunk, std::min(total, (c + 1) * chunk));
  });
}

// exp for the SiLU: range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial, about 1 ulp,
// written so the compiler vectorises the loop around it.
inline float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  // round to nearest through the float mantissa (exact here: no FMA contraction, no fast-math)
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ---- 8 lanes at a time on AVX2 (GCC leaves the loops below scalar there: the bf16 rounding and the
// exponent bits defeat its vectoriser). Same arithmetic in the same order, so the same values. ----
#include <immintrin.h>
#define PAGODA_AVX2_OPS 1

using pagoda::bf16_lanes;
using pagoda::load8;
using pagoda::store8;

// the value an fp32 result takes once stored in T and read back
template <typename T> inline __m256 round8(__m256 v);
template <> inline __m256 round8<float>(__m256 v) { return v; }
template <> inline __m256 round8<at::BFloat16>(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_lanes(v), 16));
}
template <> inline __m256 round8<at::Half>(__m256 v) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp_approx below, 8 lanes, each product and sum rounded separately (no FMA) as the scalar code does
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 shifter = _mm256_set1_ps(12582912.f);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), shifter), shifter);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(1.428606765330187e-06f)));
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f / 120.f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f / 24.f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f / 6.f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0.5f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// rows per parallel chunk: about 32k elements each, so small batches stay on one thread
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

// ---- RMSNorm ------------------------------------------------------------------------------

// A row's sum of squares in float32, for the RMSNorm kernel and the fused q/k norm alike. One function, not
// inlined: the compiler vectorizes the reduction once, so a head normed by either kernel sums in the same order
// (inlined into each, AVX-512 builds split the two loops' partial sums differently and float32 rows differed).
template <typename T>
__attribute__((noinline)) float sum_of_squares(const T* x, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f(x[i]);
    sum += v * v;
  }
  return sum;
}

// residual (if given) += x, rounded to T; then out = rms_norm(that) * weight. out may be x.
template <typename T>
void add_rms_norm_impl(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      T* res = residual ? residual + r * hidden : nullptr;
      float sum = 0.f;
      // the residual sum and the sum of squares stay in these loops on AVX2 too: with 8-lane partial sums, a
      // tiny random model's greedy tokens flipped on a near-tie against HF transformers (the output loop is 8-lane)
      const int64_t i0 = 0;
      if (res) {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = i0; i < hidden; ++i) {
          const float v = round_to<T>(to_f(xr[i]) + to_f(res[i]));
          res[i] = from_f<T>(v);
          sum += v * v;
        }
      } else {
        sum = sum_of_squares(xr, hidden);
      }
      const T* src = res ? res : xr;
      T* o = out + r * hidden;
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      int64_t i1 = 0;
#ifdef PAGODA_AVX2_OPS
      const __m256 iv = _mm256_set1_ps(inv);
      for (; i1 + 8 <= hidden; i1 += 8) store8(o + i1, _mm256_mul_ps(_mm256_mul_ps(load8(src + i1), iv), load8(weight + i1)));
#endif
#pragma omp simd
      for (int64_t i = i1; i < hidden; ++i) o[i] = from_f<T>(to_f(src[i]) * inv * to_f(weight[i]));
    }
  });
}

// ---- SiLU(gate) * up ------------------------------------------------------------------------

template <typename T>
void silu_and_mul_impl(const T* gate_up, T* out, int64_t rows, int64_t inter, int64_t row_stride) {
  at::parallel_for(0, rows, grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * row_stride;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i0 = 0;
#ifdef PAGODA_AVX2_OPS
      const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
      for (; i0 + 8 <= inter; i0 += 8) {
        const __m256 gv = load8(g + i0);
        const __m256 sv = round8<T>(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign)))));
        store8(o + i0, _mm256_mul_ps(sv, load8(u + i0)));
      }
#endif
#pragma omp simd
      for (int64_t i = i0; i < inter; ++i) {
        const float gv = to_f(g[i]);
        const float s = round_to<T>(gv / (1.f + exp_approx(-gv)));  // F.silu stores in T
        o[i] = from_f<T>(s * to_f(u[i]));
      }
    }
  });
}

// ---- GELU(gate, tanh approximation) * up --------------------------------------------------------
//
// 0.5 x (1 + tanh(u)) is x / (1 + exp(-2u)) exactly, u = sqrt(2 / pi) (x + 0.044715 x^3): the SiLU's exp, so
// the same ~1 ulp as there against torch's tanh.

template <typename T>
void gelu_tanh_and_mul_impl(const T* gate_up, T* out, int64_t rows, int64_t inter, int64_t row_stride) {
  constexpr float kTwoBeta = -2.f * 0.7978845608028654f;  // -2 sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  at::parallel_for(0, rows, grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * row_stride;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i0 = 0;
#ifdef PAGODA_AVX2_OPS
      const __m256 one = _mm256_set1_ps(1.f), two_beta = _mm256_set1_ps(kTwoBeta), kappa = _mm256_set1_ps(kKappa);
      for (; i0 + 8 <= inter; i0 += 8) {
        const __m256 x = load8(g + i0);
        const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        const __m256 arg = _mm256_mul_ps(two_beta, _mm256_add_ps(x, _mm256_mul_ps(kappa, x3)));
        const __m256 gelu = round8<T>(_mm256_div_ps(x, _mm256_add_ps(one, exp8(arg))));
        store8(o + i0, _mm256_mul_ps(gelu, load8(u + i0)));
      }
#endif
#pragma omp simd
      for (int64_t i = i0; i < inter; ++i) {
        const float x = to_f(g[i]);
        const float gelu = round_to<T>(x / (1.f + exp_approx(kTwoBeta * (x + kKappa * (x * x * x)))));  // stored in T
        o[i] = from_f<T>(gelu * to_f(u[i]));
      }
    }
  });
}

// ---- rotary embedding ("rotate half" layout), in place on the q and k heads -----------------

// one head x [head_dim] in place by its position's cos/sin rows:
// out = x * cos + cat(-x2, x1) * sin, each product and the sum rounded to T as torch does
template <typename T>
inline void rotate_head(T* x, const T* c, const T* s, int64_t half) {
  int64_t i0 = 0;
#ifdef PAGODA_AVX2_OPS
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (; i0 + 8 <= half; i0 += 8) {
    const __m256 x1 = load8(x + i0), x2 = load8(x + i0 + half);
    const __m256 lo = _mm256_add_ps(round8<T>(_mm256_mul_ps(x1, load8(c + i0))),
                                    round8<T>(_mm256_mul_ps(_mm256_xor_ps(x2, sign), load8(s + i0))));
    const __m256 hi = _mm256_add_ps(round8<T>(_mm256_mul_ps(x2, load8(c + i0 + half))),
                                    round8<T>(_mm256_mul_ps(x1, load8(s + i0 + half))));
    store8(x + i0, lo);
    store8(x + i0 + half, hi);
  }
#endif
#pragma omp simd
  for (int64_t i = i0; i < half; ++i) {
    const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
    const float lo = round_to<T>(x1 * to_f(c[i])) + round_to<T>(-x2 * to_f(s[i]));
    const float hi = round_to<T>(x2 * to_f(c[i + half])) + round_to<T>(x1 * to_f(s[i + half]));
    x[i] = from_f<T>(lo);
    x[i + half] = from_f<T>(hi);
  }
}

template <typename T>
void rotary_impl(T* qkv, int64_t row_stride, const T* cos, const T* sin, const int64_t* positions, int64_t tokens,
                 int64_t rotated_heads, int64_t head_dim) {
  at::parallel_for(0, tokens, grain(rotated_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + positions[t] * head_dim;
      const T* s = sin + positions[t] * head_dim;
      for (int64_t h = 0; h < rotated_heads; ++h) rotate_head(qkv + t * row_stride + h * head_dim, c, s, head_dim / 2);
    }
  });
}

// ---- per-head RMSNorm of q and k, then the rotary embedding, in place (Qwen3, Gemma 3) ------------
//
// Each of a token's first `heads` heads is normed with q_weight, the next `kv_heads` with k_weight, as
// add_rms_norm_impl norms a row (no residual), the result rounded to T; then rotated as rotary_impl does.
// The same values as the RMSNorm kernel on q and k followed by the rotary embedding, in one pass.
template <typename T>
void qk_norm_rotary_impl(T* qkv, int64_t row_stride, const T* q_weight, const T* k_weight, float eps, const T* cos,
                         const T* sin, const int64_t* positions, int64_t tokens, int64_t heads, int64_t kv_heads,
                         int64_t head_dim) {
  at::parallel_for(0, tokens, grain((heads + kv_heads) * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos != nullptr ? cos + positions[t] * head_dim : nullptr;
      const T* s = sin != nullptr ? sin + positions[t] * head_dim : nullptr;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        T* x = qkv + t * row_stride + h * head_dim;
        const T* w = h < heads ? q_weight : k_weight;
        const float sum = sum_of_squares(x, head_dim);
        const float inv = 1.f / std::sqrt(sum / static_cast<float>(head_dim) + eps);
        int64_t i1 = 0;
#ifdef PAGODA_AVX2_OPS
        const __m256 iv = _mm256_set1_ps(inv);
        for (; i1 + 8 <= head_dim; i1 += 8) store8(x + i1, _mm256_mul_ps(_mm256_mul_ps(load8(x + i1), iv), load8(w + i1)));
#endif
#pragma omp simd
        for (int64_t i = i1; i < head_dim; ++i) x[i] = from_f<T>(to_f(x[i]) * inv * to_f(w[i]));
        if (c != nullptr) rotate_head(x, c, s, head_dim / 2);
      }
    }
  });
}

// ---- bf16 GEMV for decode-sized batches -------------------------------------------------------
//
// y[M, N] = x[M, K] W[N, K]^T for small M, streaming W once: a tile of 4 weight rows is dotted
// with every row of x (held in L1) through AVX-512 BF16 dot-product instructions, fp32 sums.

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kHasBf16Dot = true;

// rows [n0, n0 + R) of W (w: row n0) against x rows [m0, m0 + MB)
template <int R, int MB>
inline void gemv_tile(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w, int64_t k, float* sums) {
  const at::BFloat16* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = w + r * k;
  pagoda::bf16_dot_tile<R, MB>(x, x_stride, rows, k, sums);
}

// MB activation rows against weight rows [n_begin, n_end), R at a time (MB x R sums in registers), then one at a
// time. Each output's sum is the same whatever MB and R are (32 lanes along K, the masked tail in the last step,
// the same lane sum), so a row's bits do not depend on how many rows came with it.
template <int MB, int R = 4>
void gemv_rows(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w, const at::BFloat16* bias,
               at::BFloat16* y, int64_t y_stride, int64_t n_begin, int64_t n_end, int64_t k) {
  float sums[MB * R];
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) {
    gemv_tile<R, MB>(x, x_stride, w + n * k, k, sums);
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r)
        y[m * y_stride + n + r] = from_f<at::BFloat16>(sums[m * R + r] + (bias ? to_f(bias[n + r]) : 0.f));
  }
  for (; n < n_end; ++n) {
    gemv_tile<1, MB>(x, x_stride, w + n * k, k, sums);
    for (int m = 0; m < MB; ++m) y[m * y_stride + n] = from_f<at::BFloat16>(sums[m] + (bias ? to_f(bias[n]) : 0.f));
  }
}
#else
constexpr bool kHasBf16Dot = false;
#endif

// ---- the same GEMV with fp32 math, for AVX2 CPUs (no bf16 dot product) ----------------------
//
// bf16 weights are widened in registers (a bf16 is the top half of an fp32: zero-extend, shift
// left 16) and multiplied by the activation rows, converted to fp32 once per call; fp32 sums of
// exact products, one bf16 rounding at the end: what F.linear of the fp32 values computes.

#if !(defined(__AVX512BF16__) && defined(__AVX512F__)) && defined(__AVX2__) && defined(__FMA__) && \
    defined(__F16C__)
#include <immintrin.h>
#define PAGODA_AVX2_GEMV 1

inline __m256 widen_bf16x8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// rows [n0, n0 + R) of W against fp32 activation rows [0, MB): sums[m * R + r]
template <int R, int MB>
inline void gemv_tile_f32(const float* x, int64_t k, const at::BFloat16* w, float* sums) {
  __m256 acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t k8 = k / 8 * 8;
  for (int64_t i = 0; i < k8; i += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = widen_bf16x8(w + r * k + i);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * k + i);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < R; ++r) {
      float s = sum_lanes(acc[m][r]);
      for (int64_t i = k8; i < k; ++i) s += to_f(w[r * k + i]) * x[m * k + i];
      sums[m * R + r] = s;
    }
  }
}

// MB activation rows against weight rows [n_begin, n_end), R at a time: 4 x 2 or 3 x 4 sums in registers, plus
// the R widened weight vectors and one activation vector (16 ymm at most). Each output's sum is the same
// whatever MB and R are (the same 8 lanes along K, the same lane sum, the same tail), so a row's bits
// do not depend on how many rows came with it.
template <int MB>
void gemv_rows_f32(const float* x, int64_t k, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* y,
                   int64_t y_stride, int64_t n_begin, int64_t n_end) {
  constexpr int R = MB <= 2 ? 4 : 3;
  float sums[MB * R];
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) {
    gemv_tile_f32<R, MB>(x, k, w + n * k, sums);
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r)
        y[m * y_stride + n + r] = from_f<at::BFloat16>(sums[m * R + r] + (bias ? to_f(bias[n + r]) : 0.f));
  }
  for (; n < n_end; ++n) {
    gemv_tile_f32<1, MB>(x, k, w + n * k, sums);
    for (int m = 0; m < MB; ++m) y[m * y_stride + n] = from_f<at::BFloat16>(sums[m] + (bias ? to_f(bias[n]) : 0.f));
  }
}
#endif

// which GEMV this build has: "avx512_bf16" (bf16 dot products), "avx2" (fp32 math), or "" (none)
constexpr const char* kGemvPath = kHasBf16Dot ? "avx512_bf16" :
#ifdef PAGODA_AVX2_GEMV
                                                "avx2";
#else
                                                "";
#endif

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

#define PAGODA_DISPATCH(dtype, NAME, ...)                                                  \
  switch (dtype) {                                                                         \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }                       \
    case at::kBFloat16: { using scalar_t = at::BFloat16; __VA_ARGS__; break; }             \
    case at::kHalf: { using scalar_t = at::Half; __VA_ARGS__; break; }                     \
    default: TORCH_CHECK(false, NAME, " supports float32, bfloat16 and float16, not ", dtype); \
  }

}  // namespace

// x, out: [rows, hidden] contiguous (out may be x); residual (optional, same shape) += x first, in place.
void add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                  double eps, at::Tensor& out) {
  check_cpu(x, "x");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(),
              "x, weight and out must be contiguous");
  const int64_t hidden = x.size(-1), rows = x.numel() / std::max<int64_t>(1, hidden);
  TORCH_CHECK(weight.numel() == hidden && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "out must have x's shape and dtype");
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(),
                "residual must be contiguous, with x's shape and dtype");
  }
  PAGODA_DISPATCH(x.scalar_type(), "add_rms_norm",
                  add_rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(),
                                              residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
                                              weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, hidden,
                                              static_cast<float>(eps)));
}

// gate_up: [rows, 2 * inter] (rows may be strided); returns silu(gate) * up: [rows, inter].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * inter] with contiguous rows");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  PAGODA_DISPATCH(gate_up.scalar_type(), "silu_and_mul",
                  silu_and_mul_impl<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter,
                                              gate_up.stride(0)));
  return out;
}

// gate_up: [rows, 2 * inter] (rows may be strided); returns gelu(gate, approximate="tanh") * up: [rows, inter].
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * inter] with contiguous rows");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  PAGODA_DISPATCH(gate_up.scalar_type(), "gelu_tanh_and_mul",
                  gelu_tanh_and_mul_impl<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows,
                                                   inter, gate_up.stride(0)));
  return out;
}

// qkv: [tokens, (heads + 2 * kv_heads) * head_dim] with contiguous rows; RMSNorm of each q head (q_weight,
// [head_dim]) and k head (k_weight), then, given cos/sin ([max_position, head_dim]) and positions ([tokens]
// int64), the rotary embedding of both, in place. v is left alone.
void qk_norm_rotary_(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight, double eps,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, const c10::optional<at::Tensor>& cos,
                     const c10::optional<at::Tensor>& sin, const c10::optional<at::Tensor>& positions) {
  check_cpu(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [tokens, width] with contiguous rows");
  TORCH_CHECK(head_dim % 2 == 0 && (heads + kv_heads) * head_dim <= qkv.size(1), "q and k heads exceed the qkv width");
  for (const at::Tensor* w : {&q_weight, &k_weight})
    TORCH_CHECK(w->is_contiguous() && w->numel() == head_dim && w->scalar_type() == qkv.scalar_type(),
                "q_weight and k_weight must be [head_dim] in qkv's dtype");
  TORCH_CHECK(cos.has_value() == sin.has_value() && cos.has_value() == positions.has_value(),
              "give cos, sin and positions together, or none of them");
  at::Tensor pos;
  if (cos.has_value()) {
    TORCH_CHECK(cos->is_contiguous() && sin->is_contiguous() && cos->size(-1) == head_dim &&
                    cos->scalar_type() == qkv.scalar_type() && sin->scalar_type() == qkv.scalar_type(),
                "cos/sin must be contiguous [max_position, head_dim] tables in qkv's dtype");
    TORCH_CHECK(positions->scalar_type() == at::kLong && positions->numel() == qkv.size(0),
                "positions must be int64, one per token");
    pos = positions->contiguous();
  }
  PAGODA_DISPATCH(qkv.scalar_type(), "qk_norm_rotary_",
                  qk_norm_rotary_impl<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.stride(0), q_weight.data_ptr<scalar_t>(),
                                                k_weight.data_ptr<scalar_t>(), static_cast<float>(eps),
                                                cos.has_value() ? cos->data_ptr<scalar_t>() : nullptr,
                                                sin.has_value() ? sin->data_ptr<scalar_t>() : nullptr,
                                                cos.has_value() ? pos.data_ptr<int64_t>() : nullptr, qkv.size(0),
                                                heads, kv_heads, head_dim));
}

// qkv: [tokens, (heads + 2 * kv_heads) * head_dim] with contiguous rows; rotates the first
// rotated_heads heads (q and k) in place. cos/sin: [max_position, head_dim]; positions: [tokens] int64.
void rotary_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
             int64_t rotated_heads, int64_t head_dim) {
  check_cpu(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [tokens, width] with contiguous rows");
  TORCH_CHECK(head_dim % 2 == 0 && rotated_heads * head_dim <= qkv.size(1), "rotated heads exceed the qkv width");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == head_dim &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos/sin must be contiguous [max_position, head_dim] tables in qkv's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == qkv.size(0),
              "positions must be int64, one per token");
  const auto pos = positions.contiguous();
  PAGODA_DISPATCH(qkv.scalar_type(), "rotary_",
                  rotary_impl<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.stride(0), cos.data_ptr<scalar_t>(),
                                        sin.data_ptr<scalar_t>(), pos.data_ptr<int64_t>(), qkv.size(0),
                                        rotated_heads, head_dim));
}

bool has_bf16_gemv() { return kGemvPath[0] != '\0'; }

std::string gemv_path() { return kGemvPath; }

// the ISA path of RMSNorm / SiLU-and-mul / RoPE: avx2 (intrinsics), avx512 (the compiler's vectorised
// loops), or generic
std::string elementwise_path() {
#if defined(PAGODA_AVX2_OPS)
  return "avx2";
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "generic";
#endif
}

// x: [M, K] bf16 with contiguous rows; weight: [N, K] bf16 contiguous; bias: [N] or none. Returns [M, N].
at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_bf16_gemv(), "this build has neither AVX-512 BF16 nor AVX2 + FMA");
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 2 && weight.is_contiguous() &&
                  x.size(1) == weight.size(1),
              "x must be [M, K] with contiguous rows and weight a contiguous [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "x and weight must be bf16");
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
  const at::BFloat16* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.numel() == n && bias_c.scalar_type() == at::kBFloat16, "bias must be [N] bf16");
    b = bias_c.data_ptr<at::BFloat16>();
  }
  auto y = at::empty({m, n}, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t xs = x.stride(0);
  // about 64 KiB of weights per chunk, in whole 4-row tiles
  const int64_t grain_rows = std::max<int64_t>(4, (32768 / std::max<int64_t>(1, k)) / 4 * 4);
  parallel_chunks(n, grain_rows, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m; m0 += 4) {
      const at::BFloat16* xm = xp + m0 * xs;
      at::BFloat16* ym = yp + m0 * n;
      switch (std::min<int64_t>(4, m - m0)) {
        case 4: gemv_rows<4>(xm, xs, wp, b, ym, n, begin, end, k); break;
        case 3: gemv_rows<3>(xm, xs, wp, b, ym, n, begin, end, k); break;
        case 2: gemv_rows<2>(xm, xs, wp, b, ym, n, begin, end, k); break;
        default: gemv_rows<1>(xm, xs, wp, b, ym, n, begin, end, k); break;
      }
    }
  });
#elif defined(PAGODA_AVX2_GEMV)
  // [M, K] activations as fp32, once: every weight tile reads them again
  const auto xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t grain_rows = std::max<int64_t>(4, (32768 / std::max<int64_t>(1, k)) / 4 * 4);
  parallel_chunks(n, grain_rows, [&](int64_t begin, int64_t end) {
    // rows of x four at a time (then two, one): the chunk's weights (about 64 KiB) stay in L2 for the next
    // rows; four rows x three weight rows of sums load 7 vectors per 12 FMAs where two x four load 6 per 8
    int64_t m0 = 0;
    for (; m - m0 >= 4; m0 += 4) gemv_rows_f32<4>(xp + m0 * k, k, wp, b, yp + m0 * n, n, begin, end);
    for (; m0 < m; m0 += 2) {
      if (m - m0 >= 2) gemv_rows_f32<2>(xp + m0 * k, k, wp, b, yp + m0 * n, n, begin, end);
      else gemv_rows_f32<1>(xp + m0 * k, k, wp, b, yp + m0 * n, n, begin, end);
    }
  });
#endif
  return y;
}

// y = x W^T (+ bias) for many bf16 rows on a CPU without bf16 math: each thread widens a tile of
// `tile_rows` weight rows to fp32 into its own buffer (in L2) and multiplies it at once by the fp32
// activations with a one-thread fp32 GEMM, so the weights stay bf16 in memory and are widened once per
// call, never all at once. One bf16 rounding at the end.
// x: [M, K] bf16 with contiguous rows; weight: [N, K] bf16 contiguous; bias: [N] or none. Returns [M, N].
at::Tensor gemm_bf16_fp32(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                          int64_t tile_rows) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 2 && weight.is_contiguous() &&
                  x.size(1) == weight.size(1),
              "x must be [M, K] with contiguous rows and weight a contiguous [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "x and weight must be bf16");
  TORCH_CHECK(tile_rows > 0, "tile_rows must be positive");
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
  // the activations widened, with zero rows up to a multiple of 16: the fp32 GEMM ran 1.5 to 2x slower on
  // 13 to 15, 31 or 47 rows than on 16, 32 or 48 (forced AVX2, the default model's linears)
  const int64_t mp = (m + 15) / 16 * 16;
  auto xf = at::empty({mp, k}, x.options().dtype(at::kFloat));
  xf.narrow(0, 0, m).copy_(x);
  if (mp > m) xf.narrow(0, m, mp - m).zero_();  // the padding rows only: a fill of the whole is a pass more
  const at::BFloat16* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.numel() == n && bias_c.scalar_type() == at::kBFloat16, "bias must be [N] bf16");
    b = bias_c.data_ptr<at::BFloat16>();
  }
  auto y = at::empty({m, n}, x.options());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  // tiles of at most tile_rows, as many per thread: 576 rows on 2 threads are 6 tiles of 96, not 5 of 128
  // (of which one thread would compute 3 and the other 2)
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t per_thread = (n + threads * tile_rows - 1) / (threads * tile_rows);
  const int64_t even_rows = (n + threads * per_thread - 1) / (threads * per_thread);
  tile_rows = std::min(tile_rows, (even_rows + 7) / 8 * 8);
  const int64_t num_tiles = (n + tile_rows - 1) / tile_rows;
  const at::ThreadLocalState caller_state;  // inference / grad mode, for the tensor ops of the worker threads
  // tiles go to the threads one at a time as they finish the last (see parallel_chunks)
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, num_tiles), 1, [&](int64_t, int64_t) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    const int64_t max_rows = std::min(tile_rows, n);
    auto tile = at::empty({max_rows, k}, xf.options());  // widened weight rows
    auto tile_y = at::empty({max_rows, mp}, xf.options());  // their outputs, transposed
    float* tp = tile.data_ptr<float>();
    const float* ty = tile_y.data_ptr<float>();
    for (int64_t t = next++; t < num_tiles; t = next++) {
      const int64_t t0 = t * tile_rows, rows = std::min(tile_rows, n - t0);
      const uint16_t* src = wp + t0 * k;
      int64_t i = 0;
#ifdef PAGODA_AVX2_GEMV
      for (; i + 8 <= rows * k; i += 8)
        _mm256_storeu_ps(tp + i, widen_bf16x8(reinterpret_cast<const at::BFloat16*>(src + i)));
#endif
      for (; i < rows * k; ++i) {
        const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
        std::memcpy(tp + i, &bits, sizeof(float));
      }
      auto out_rows = tile_y.narrow(0, 0, rows);
      at::mm_out(out_rows, tile.narrow(0, 0, rows), xf.t());  // one thread here: inside a parallel region
      // [rows, M] -> columns t0 .. t0 + rows of y [M, N], while the tile is in cache
      for (int64_t r0 = 0; r0 < m; ++r0) {
        at::BFloat16* yr = yp + r0 * n + t0;
        for (int64_t r = 0; r < rows; ++r) yr[r] = from_f<at::BFloat16>(ty[r * mp + r0] + (b ? to_f(b[t0 + r]) : 0.f));
      }
    }
  });
  return y;
}

// y = x W^T (+ bias) for prefill-sized row counts on a CPU without bf16 math. gemm_bf16_fp32 above gives each
// thread whole weight tiles against every activation row, so each tile's one-thread GEMM re-reads (and the BLAS
// re-packs) all M activation rows: at a thousand rows and more that traffic costs more than widening the weights.
// Here the weights are widened a chunk of `chunk_rows` rows at a time into one fp32 buffer both threads share
// (widened once per call, never the whole matrix at once), and the threads take blocks of `row_block`
// activation rows one at a time, each a one-thread fp32 GEMM against the whole chunk, whose outputs are
// rounded to bf16 (bias added in fp32 first) while they are in cache.
at::Tensor gemm_bf16_fp32_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                               int64_t row_block, int64_t chunk_rows) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 2 && weight.is_contiguous() &&
                  x.size(1) == weight.size(1),
              "x must be [M, K] with contiguous rows and weight a contiguous [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "x and weight must be bf16");
  TORCH_CHECK(row_block > 0 && chunk_rows > 0, "row_block and chunk_rows must be positive");
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
  const auto xf = x.to(at::kFloat).contiguous();
  const at::BFloat16* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.numel() == n && bias_c.scalar_type() == at::kBFloat16, "bias must be [N] bf16");
    b = bias_c.data_ptr<at::BFloat16>();
  }
  auto y = at::empty({m, n}, x.options());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  chunk_rows = std::min(chunk_rows, n);
  auto wf = at::empty({chunk_rows, k}, xf.options());
  float* wfp = wf.data_ptr<float>();
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  // blocks of at most row_block rows, as many per thread
  const int64_t per_thread = (m + threads * row_block - 1) / (threads * row_block);
  row_block = std::min(row_block, (m + threads * per_thread - 1) / (threads * per_thread));
  const int64_t num_blocks = (m + row_block - 1) / row_block;
  const at::ThreadLocalState caller_state;
  for (int64_t n0 = 0; n0 < n; n0 += chunk_rows) {
    const int64_t nc = std::min(chunk_rows, n - n0);
    const uint16_t* src = wp + n0 * k;
    parallel_chunks(nc * k, 32768, [&](int64_t begin, int64_t end) {
      int64_t i = begin;
#ifdef PAGODA_AVX2_GEMV
      for (; i + 8 <= end; i += 8)
        _mm256_storeu_ps(wfp + i, widen_bf16x8(reinterpret_cast<const at::BFloat16*>(src + i)));
#endif
      for (; i < end; ++i) {
        const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
        std::memcpy(wfp + i, &bits, sizeof(float));
      }
    });
    const auto chunk_t = wf.narrow(0, 0, nc).t();
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min(threads, num_blocks), 1, [&](int64_t, int64_t) {
      at::ThreadLocalStateGuard state_guard(caller_state);
      auto out = at::empty({row_block, nc}, xf.options());
      const float* op = out.data_ptr<float>();
      for (int64_t blk = next++; blk < num_blocks; blk = next++) {
        const int64_t r0 = blk * row_block, rows = std::min(row_block, m - r0);
        auto out_rows = out.narrow(0, 0, rows);
        at::mm_out(out_rows, xf.narrow(0, r0, rows), chunk_t);  // one thread: inside a parallel region
        for (int64_t r = 0; r < rows; ++r) {
          const float* o = op + r * nc;
          at::BFloat16* yr = yp + (r0 + r) * n + n0;
          const at::BFloat16* br = b ? b + n0 : nullptr;
          int64_t c = 0;
#ifdef PAGODA_AVX2_OPS
          if (br) {
            for (; c + 8 <= nc; c += 8) store8(yr + c, _mm256_add_ps(_mm256_loadu_ps(o + c), load8(br + c)));
          } else {
            for (; c + 8 <= nc; c += 8) store8(yr + c, _mm256_loadu_ps(o + c));
          }
#endif
          for (; c < nc; ++c) yr[c] = from_f<at::BFloat16>(o[c] + (br ? to_f(br[c]) : 0.f));
        }
      }
    });
  }
  return y;
}

// every kernel runs without the GIL: a server's event loop and tokenizer thread go on while a step
// computes (the arguments are converted before the call and the result after it, both with the GIL)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const pybind11::call_guard<pybind11::gil_scoped_release> no_gil{};
  m.def("gemm_bf16_fp32", &gemm_bf16_fp32, "y = x W^T (+ bias) for many bf16 rows, fp32 GEMM over widened tiles",
        no_gil, pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("tile_rows") = 128);
  m.def("gemm_bf16_fp32_rows", &gemm_bf16_fp32_rows,
        "y = x W^T (+ bias) for prefill-sized bf16 row counts, widened weight chunks shared by the threads", no_gil,
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("row_block") = 256,
        pybind11::arg("chunk_rows") = 1024);
  m.def("add_rms_norm", &add_rms_norm, "residual += x (in place); out = rms_norm(residual) * weight", no_gil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over a fused gate_up projection", no_gil);
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu(gate, tanh approximation) * up over a fused gate_up projection",
        no_gil);
  m.def("qk_norm_rotary_", &qk_norm_rotary_,
        "per-head RMSNorm of the q and k heads of a fused qkv row, then their rotary embedding, in place", no_gil,
        pybind11::arg("qkv"), pybind11::arg("q_weight"), pybind11::arg("k_weight"), pybind11::arg("eps"),
        pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("head_dim"),
        pybind11::arg("cos") = pybind11::none(), pybind11::arg("sin") = pybind11::none(),
        pybind11::arg("positions") = pybind11::none());
  m.def("has_bf16_gemv", &has_bf16_gemv, "whether gemv_bf16 was built (AVX-512 BF16, or AVX2 + FMA)");
  m.def("gemv_path", &gemv_path, "the ISA path of gemv_bf16: avx512_bf16, avx2, or empty (none)");
  m.def("elementwise_path", &elementwise_path, "the ISA path of RMSNorm / SiLU-and-mul / RoPE");
  m.def("gemv_bf16", &gemv_bf16, "y = x W^T (+ bias) for a few bf16 rows, streaming W once", no_gil);
  m.def("rotary_", &rotary_, "rotary embedding in place on the q and k heads of a fused qkv row", no_gil);
}
