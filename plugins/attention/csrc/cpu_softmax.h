// What pagoda's two CPU attention kernels share: the online softmax's update (cpu_prefill.cpp's
// flash-style items, on AVX-512 BF16 and on AVX2), 2^x for softmax inputs (one polynomial, for one
// value, 8 lanes and 16 lanes: cpu_kernels.cpp's decode softmax and cpu_prefill.cpp's items), and the
// 8-lane fp32 pieces of their AVX2 paths: horizontal max and sum, and the widening loads and rounding
// stores of fp32, bf16 and fp16 rows.
//
// Both sources include it by a path relative to their own directory; the backend puts this file's
// digest into the build flags, so a change here builds both kernels anew.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
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

// 8 values widened to fp32 (bf16: zero-extend and shift left 16; fp16 through vcvtph2ps)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// 8 fp32 values rounded to nearest even into the row's dtype (the values are finite)
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  // 32-bit lanes holding 16-bit values: pack per 128-bit half, then gather the two halves' low quads
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

#endif

}  // namespace pagoda_attention
