// What pagoda's two CPU attention kernels share: the online softmax's update (cpu_prefill.cpp's
// flash-style items, on AVX-512 BF16 and on AVX2), 2^x for softmax inputs (one polynomial, for one
// value, 8 lanes and 16 lanes: cpu_kernels.cpp's decode softmax and cpu_prefill.cpp's items), tanh on
// 8 and 16 lanes for soft-capped scores, and the
// 8-lane fp32 pieces of their AVX2 paths: horizontal max and sum, and the widening loads and rounding
// stores of fp32, bf16 and fp16 rows.
//
// Both sources include it by a path relative to their own directory; the backend puts this file's
// digest into the build flags, so a change here builds both kernels anew.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "pagoda_vec8.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagoda_attention {

// The online softmax over base-2 scores, one row, block by block: with m the row's running max and l the
// running sum of 2^(x - m) over the keys seen so far (m = -inf, l = 0 before the first block), a block whose
// largest score is block_max moves m to max(m, block_max). The block's probabilities are then 2^(x - m), and
// what was accumulated before it (l, and the output rows) is rescaled by alpha = 2^(m_old - m_new):
//   l = l * alpha + sum(p);  o = o * alpha + p . V
// Returns m_old - m_new, the base-2 log of alpha: -inf before the first block (alpha = 0; exp2(-inf) is 0).
// The caller takes 2^ of it as it exponentiates: per row (std::exp2), or for 16 rows at once.
inline float online_softmax_advance(float& m, float block_max) {
  const float m_new = std::max(m, block_max);
  const float log2_alpha = m - m_new;
  m = m_new;
  return log2_alpha;
}

// 2^x for x <= 0 as 2^n * 2^f, n = round(x) built in the exponent bits and 2^f (f in [-0.5, 0.5]) by its
// degree-6 Taylor polynomial (relative error ~1.2e-7); inputs below -126 give 2^-126 instead of a
// subnormal or zero. One value here (vectorizable under omp simd), then 8 and 16 lanes, same arithmetic.
inline float exp2_1(float x) {
  x = std::max(x, -126.f);
  const float n = std::floor(x + 0.5f);
  const float f = x - n;
  float p = 1.540353e-4f;
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

#if defined(__AVX512F__)
// exp2_1 on 16 lanes (masked lanes are the caller's to zero)
inline __m512 exp2_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.540353e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// tanh on 16 lanes, as tanh8 below computes it
inline __m512 tanh16(__m512 x) {
  const __m512 a = _mm512_min_ps(_mm512_abs_ps(x), _mm512_set1_ps(9.f));
  const __m512 e = exp2_16(_mm512_mul_ps(a, _mm512_set1_ps(-2.8853900817779268f)));
  const __m512 far = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.f), e), _mm512_add_ps(_mm512_set1_ps(1.f), e));
  const __m512 a2 = _mm512_mul_ps(a, a);
  __m512 p = _mm512_set1_ps(-17.f / 315.f);
  p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(2.f / 15.f));
  p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(-1.f / 3.f));
  const __m512 near = _mm512_fmadd_ps(_mm512_mul_ps(p, a2), a, a);
  const __m512 t = _mm512_mask_mov_ps(far, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.125f), _CMP_LT_OQ), near);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(_mm512_castps_si512(x),
                                                                                       _mm512_set1_epi32(INT32_MIN))));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// exp2_1 on 8 lanes
inline __m256 exp2_8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.540353e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// tanh on 8 lanes (what a logit soft-cap needs): for |x| >= 1/8, (1 - e) / (1 + e) with e = exp(-2|x|) by
// exp2_8 (|x| capped at 9, where tanh is 1 in fp32); below, the odd Taylor series to x^7 (error < 2e-10), where
// 1 - e would lose the leading bits. The sign is x's.
inline __m256 tanh8(__m256 x) {
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  const __m256 a = _mm256_min_ps(_mm256_andnot_ps(sign_bit, x), _mm256_set1_ps(9.f));
  const __m256 e = exp2_8(_mm256_mul_ps(a, _mm256_set1_ps(-2.8853900817779268f)));  // -2 log2(e)
  const __m256 far = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.f), e), _mm256_add_ps(_mm256_set1_ps(1.f), e));
  const __m256 a2 = _mm256_mul_ps(a, a);
  __m256 p = _mm256_set1_ps(-17.f / 315.f);
  p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(2.f / 15.f));
  p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(-1.f / 3.f));
  const __m256 near = _mm256_fmadd_ps(_mm256_mul_ps(p, a2), a, a);
  const __m256 t = _mm256_blendv_ps(far, near, _mm256_cmp_ps(a, _mm256_set1_ps(0.125f), _CMP_LT_OQ));
  return _mm256_or_ps(t, _mm256_and_ps(x, sign_bit));
}

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 8 values widened to fp32 and stored rounded (pagoda_vec8.h)
using pagoda::load8;
using pagoda::store8;

#endif

}  // namespace pagoda_attention
