// Paged attention for x86 CPUs: queries attend over K/V read in place from the block pool.
//
// KV layout (shared with the torch backend): [2, num_kv_heads, num_blocks, block_size, head_dim].
// One work item is (query token, kv head): the group of query heads sharing that kv head reads
// every K/V row once, accumulating in fp32. No gathered copy of K/V is ever made.
//
// The cache holds the model dtype, or fp8 e4m3 bytes (float8_e4m3fn) widened with bit arithmetic.
// Stored K/V are multiplied by k_scale / v_scale on read: k_scale is folded into the query
// scale and v_scale into the output, so no row is ever rescaled.

#include "pagoda_torch.h"
#include <ATen/ops/empty.h>
#include <c10/util/Float8_e4m3fn.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "csrc/cpu_softmax.h"

namespace {

// What a layer with a sliding window, a logit soft-cap or attention sinks does to one item's scores before
// its softmax: `masked` leading keys fall outside the window, scores become tanh(s / softcap) * softcap, and
// each query head's sink logit joins the softmax's denominator only (nullptr: none).
struct ScoreShape {
  int64_t masked = 0;
  float softcap = 0.f;
  const float* sinks = nullptr;  // the item's `group` query heads' sinks
  bool plain() const { return masked == 0 && softcap == 0.f && sinks == nullptr; }
};

// `softmax(scores, rows, len, out_scale)` over each row of scores, shaped first as `shape` says; with sinks a
// row's probabilities are scaled by sum / (sum + exp(sink)) (in its max's units), the sink's share
template <typename Softmax>
inline void shaped_softmax(float* scores, int64_t rows, int64_t len, float out_scale, const ScoreShape& shape,
                           Softmax softmax) {
  if (shape.plain()) {
    softmax(scores, rows, len, out_scale);
    return;
  }
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * len;
    for (int64_t i = 0; i < shape.masked; ++i) sg[i] = -std::numeric_limits<float>::infinity();
    if (shape.softcap > 0.f) {
      int64_t i = shape.masked;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
      const __m256 inv = _mm256_set1_ps(1.f / shape.softcap), cap = _mm256_set1_ps(shape.softcap);
      for (; i + 8 <= len; i += 8)
        _mm256_storeu_ps(sg + i, _mm256_mul_ps(pagoda_attention::tanh8(_mm256_mul_ps(_mm256_loadu_ps(sg + i), inv)), cap));
#endif
      for (; i < len; ++i) sg[i] = std::tanh(sg[i] / shape.softcap) * shape.softcap;
    }
    float row_scale = out_scale;
    if (shape.sinks != nullptr) {
      float m = shape.sinks[g];
      for (int64_t i = shape.masked; i < len; ++i) m = std::max(m, sg[i]);
      double sum = 0.0;
      int64_t i = shape.masked;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
      // e^(s - m) as 2^((s - m) log2 e), 8 lanes (s - m <= 0)
      const __m256 log2e = _mm256_set1_ps(1.4426950408889634f), mv = _mm256_set1_ps(m);
      __m256 acc = _mm256_setzero_ps();
      for (; i + 8 <= len; i += 8)
        acc = _mm256_add_ps(acc, pagoda_attention::exp2_8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(sg + i), mv), log2e)));
      sum = pagoda_attention::sum8(acc);
#endif
      for (; i < len; ++i) sum += std::exp(static_cast<double>(sg[i] - m));
      row_scale = static_cast<float>(out_scale * sum / (sum + std::exp(static_cast<double>(shape.sinks[g] - m))));
    }
    softmax(sg, 1, len, row_scale);
  }
}

inline void load_row(const float* src, float* dst, int n) {
  std::memcpy(dst, src, sizeof(float) * n);
}

inline void load_row(const at::BFloat16* src, float* dst, int n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    dst[i] = f;
  }
}

inline void load_row(const at::Half* src, float* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// e4m3fn bytes -> float, exact. The magnitude bits shifted into an fp16 (sign to bit 15) give the
// value times 2^-8, subnormals included, so AVX-512 widens 16 codes with vcvtph2ps and one multiply.
// Codes 0x7f / 0xff (NaN) are never written (writes saturate at +-448).
inline float fp8_e4m3_to_float(uint8_t code) {
  const uint32_t mag = code & 0x7Fu;
  // exponent field e >= 1: an fp32 with exponent e + 120 and the same 3 mantissa bits; e == 0: m * 2^-9
  const uint32_t normal_bits = (mag << 20) + (120u << 23);
  float value;
  std::memcpy(&value, &normal_bits, sizeof(value));
  if (mag < 8u) value = static_cast<float>(mag) * 0.001953125f;
  return (code & 0x80u) ? -value : value;
}

#if defined(__AVX512F__)
inline __m512 fp8x16_to_float(const uint8_t* codes) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7),
                                       _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f));
}
#endif

inline void load_row(const c10::Float8_e4m3fn* src, float* dst, int n) {
  const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, fp8x16_to_float(s + i));
#endif
  for (; i < n; ++i) dst[i] = fp8_e4m3_to_float(s[i]);
}

// exp(x) for softmax inputs (x <= 0) = 2^(x log2 e) (pagoda_attention::exp2_1, vectorizable under omp
// simd); inputs below -87 give exp(-87) ~ 1.6e-38 instead of underflowing
inline float exp_approx(float x) { return pagoda_attention::exp2_1(std::max(x, -87.f) * 1.44269504088896341f); }

#if defined(__AVX512F__)
// exp_approx on 16 lanes. GCC leaves exp_approx's loops scalar (floor and the exponent bits), so softmax
// was 40% of a bf16 decode item; this is the same arithmetic in registers.
inline __m512 exp_ps(__m512 x) {
  return pagoda_attention::exp2_16(
      _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504088896341f)));
}

// softmax_rows with every pass 16 scores at a time (a masked tail)
inline void softmax_rows_x16(float* scores, int64_t rows, int64_t len, float out_scale) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * len;
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 k = len - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - i)) - 1u);
      m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, sg + i));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 k = len - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - i)) - 1u);
      const __m512 e = _mm512_maskz_mov_ps(k, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + i), mx)));
      _mm512_mask_storeu_ps(sg + i, k, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(out_scale / _mm512_reduce_add_ps(sum));
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 k = len - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - i)) - 1u);
      _mm512_mask_storeu_ps(sg + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sg + i), inv));
    }
  }
}
#endif

// softmax over each of `rows` rows of `len` scores, in place, times `out_scale` (v_scale is folded
// in here, so no value row is rescaled); vectorised: a scalar expf per score was a kernel's largest cost
inline void softmax_rows(float* scores, int64_t rows, int64_t len, float out_scale) {
#if defined(__AVX512F__)
  softmax_rows_x16(scores, rows, len, out_scale);
#else
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * len;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < len; ++i) m = std::max(m, sg[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < len; ++i) {
      sg[i] = exp_approx(sg[i] - m);
      sum += sg[i];
    }
    const float inv = out_scale / sum;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) sg[i] *= inv;
  }
#endif
}

inline void store_row(const float* src, float* dst, int n) { std::memcpy(dst, src, sizeof(float) * n); }

inline void store_row(const float* src, at::BFloat16* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<at::BFloat16>(src[i]);
}

inline void store_row(const float* src, at::Half* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<at::Half>(src[i]);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
constexpr bool kHasBf16Kernel = true;

// sum of each of 16 registers, as one register (lane r = sum of a[r]): a shuffle-and-add tree
inline __m512 sum16(const __m512* a) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sum for 4 consecutive registers
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
    y[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  for (int i = 0; i < 2; ++i) {  // lanes: [regs 0-3 half, regs 0-3 other half, regs 4-7 half, ...]
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

inline __m512 load_bf16x16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 cache values as fp32: bf16 or fp8 e4m3 codes (exact either way)
inline __m512 load_x16(const at::BFloat16* p) { return load_bf16x16(p); }
inline __m512 load_x16(const c10::Float8_e4m3fn* p) { return fp8x16_to_float(reinterpret_cast<const uint8_t*>(p)); }

// out[g, d0 : d0 + 16 * NS] = sum_j p[g, j] * V[j, same slice], with the G x NS sums in registers
// out[g0 + g, d0 : d0 + 16 * NS] for GH heads = sum_j p[g, j] * V[j, same slice]. GH and NS are
// compile-time so the GH x NS sums stay in registers (with a runtime count they spill to the stack,
// and every FMA waits on a store).
template <int NS, int GH, typename cache_t>
void weighted_values_heads(const cache_t* v_head, const int32_t* table, int64_t len, int64_t block_size,
                           int64_t head_dim, int64_t d0, int64_t g0, const float* probs, at::BFloat16* out) {
  __m512 acc[GH][NS];
  for (int g = 0; g < GH; ++g)
    for (int s = 0; s < NS; ++s) acc[g][s] = _mm512_setzero_ps();
  for (int64_t start = 0; start < len; start += block_size) {
    const cache_t* v_block = v_head + static_cast<int64_t>(table[start / block_size]) * block_size * head_dim + d0;
    const int64_t n = std::min<int64_t>(block_size, len - start);
    const float* p_row = probs + g0 * len + start;
    for (int64_t j = 0; j < n; ++j) {
      __m512 v[NS];
      for (int s = 0; s < NS; ++s) v[s] = load_x16(v_block + j * head_dim + 16 * s);
      for (int g = 0; g < GH; ++g) {
        const __m512 p = _mm512_set1_ps(p_row[g * len + j]);
        for (int s = 0; s < NS; ++s) acc[g][s] = _mm512_fmadd_ps(p, v[s], acc[g][s]);
      }
    }
  }
  for (int g = 0; g < GH; ++g) {
    for (int s = 0; s < NS; ++s) {
      // fp32 -> bf16, round to nearest even (the values are finite)
      const __m512i bits = _mm512_castps_si512(acc[g][s]);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (g0 + g) * head_dim + d0 + 16 * s), _mm512_cvtepi32_epi16(r));
    }
  }
}

// every head of the group, up to three at a time (12 sums of 16 lanes in registers for NS = 4)
template <int NS, typename cache_t>
void weighted_values(const cache_t* v_head, const int32_t* table, int64_t len, int64_t block_size,
                     int64_t head_dim, int64_t d0, int64_t group, const float* probs, at::BFloat16* out) {
  int64_t g0 = 0;
  for (; g0 + 3 <= group; g0 += 3)
    weighted_values_heads<NS, 3>(v_head, table, len, block_size, head_dim, d0, g0, probs, out);
  if (group - g0 == 2) weighted_values_heads<NS, 2>(v_head, table, len, block_size, head_dim, d0, g0, probs, out);
  if (group - g0 == 1) weighted_values_heads<NS, 1>(v_head, table, len, block_size, head_dim, d0, g0, probs, out);
}

// One (token, kv head) work item over a bf16 cache, for head_dim % 32 == 0 and block_size % 16 == 0.
// Pass 1 dots 16 key rows at a time with each query head (AVX-512 BF16 pairs, fp32 sums) and folds
// the 16 partial-sum registers into one register of 16 scores. Pass 2 sweeps the value rows with
// the output sums of up to four 16-wide slices of head_dim held in registers.
// An fp8 cache (head_dim <= kMaxFp8HeadDim) is widened 16 key rows at a time into a bf16 tile (exact:
// e4m3 values are bf16 values) and value rows 16 codes at a time.
constexpr int64_t kMaxFp8HeadDim = 256;
constexpr int64_t kFarTile = 3;  // tiles of 16 keys ahead for the L2 prefetch

// prefetch `rows` key rows (hint KH) and value rows (hint VH) from position `pos` of a sequence; a tile of
// 16 never crosses a block (block_size % 16 == 0), so rows past the sequence's end are still in its block
template <int KH, int VH, typename cache_t>
inline void prefetch_tile(const cache_t* k_head, const cache_t* v_head, const int32_t* table, int64_t pos,
                          int64_t rows, int64_t block_size, int64_t head_dim) {
  const int64_t offset = (static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size) * head_dim;
  const char* k = reinterpret_cast<const char*>(k_head + offset);
  const char* v = reinterpret_cast<const char*>(v_head + offset);
  for (int64_t b = 0; b < rows * head_dim * static_cast<int64_t>(sizeof(cache_t)); b += 64) {
    _mm_prefetch(k + b, static_cast<_mm_hint>(KH));
    _mm_prefetch(v + b, static_cast<_mm_hint>(VH));
  }
}

template <typename cache_t>
void decode_item_bf16(const at::BFloat16* q, int64_t q_stride_h, int64_t group, const cache_t* k_head,
                      const cache_t* v_head, const int32_t* table, int64_t len, int64_t block_size,
                      int64_t head_dim, float qk_scale, float v_scale, const ScoreShape& shape, float* scores,
                      at::BFloat16* out) {
  constexpr bool kFp8 = std::is_same_v<cache_t, c10::Float8_e4m3fn>;
  alignas(64) at::BFloat16 tile[kFp8 ? 16 * kMaxFp8HeadDim : 1];
  const __m512 scale = _mm512_set1_ps(qk_scale);
  const int64_t chunks = head_dim / 32;
  // pass 1: scores [group, len]
  for (int64_t start = 0; start < len; start += 16) {
    const int64_t n = std::min<int64_t>(16, len - start);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    const cache_t* key_rows =
        k_head + (static_cast<int64_t>(table[start / block_size]) * block_size + start % block_size) * head_dim;
    const at::BFloat16* rows;
    if constexpr (kFp8) {
      const uint8_t* codes = reinterpret_cast<const uint8_t*>(key_rows);
      for (int64_t i = 0; i < n * head_dim; i += 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + i), (__m256i)_mm512_cvtneps_pbh(fp8x16_to_float(codes + i)));
      }
      rows = tile;
    } else {
      rows = key_rows;
    }
    if (start + 16 < len) {
      // fetch the next 16 key rows, and the value rows pass 2 will read, while this chunk computes:
      // blocks are scattered, so the hardware prefetcher cannot guess them
      prefetch_tile<_MM_HINT_T0, _MM_HINT_T1>(k_head, v_head, table, start + 16, std::min<int64_t>(16, len - start - 16),
                                              block_size, head_dim);
    }
    if (start + 16 * kFarTile < len) {
      // and a tile further on into L2, so that the near prefetch above finds it there: more of the
      // scattered blocks are in flight at once (W1's decode state, 64 requests, per layer: 0.41-0.52 ms
      // -> 0.38-0.49 ms on 2 threads, 0.72-0.77 -> 0.62-0.74 ms on 1; 4 or 6 tiles ahead gained less)
      prefetch_tile<_MM_HINT_T2, _MM_HINT_T2>(k_head, v_head, table, start + 16 * kFarTile, 16, block_size, head_dim);
    }
    if (start == 0) {
      for (int64_t ahead = 32; ahead < std::min<int64_t>(len, 16 * kFarTile); ahead += 16) {  // the tiles between
        prefetch_tile<_MM_HINT_T2, _MM_HINT_T2>(k_head, v_head, table, ahead, 16, block_size, head_dim);
      }
      for (int64_t b = 0; b < n * head_dim * static_cast<int64_t>(sizeof(cache_t)); b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(v_head + (key_rows - k_head)) + b, _MM_HINT_T1);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const at::BFloat16* qg = q + g * q_stride_h;
      // all 16 rows, a compile-time count, so the sums stay in registers: a tile never crosses a
      // block (block_size % 16 == 0), and the lanes of rows past `n` are masked off when stored
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512bh qc = (__m512bh)_mm512_loadu_si512(qg + 32 * c);
        for (int r = 0; r < 16; ++r) {
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(rows + r * head_dim + 32 * c), qc);
        }
      }
      _mm512_mask_storeu_ps(scores + g * len + start, mask, _mm512_mul_ps(sum16(acc), scale));
    }
  }
  shaped_softmax(scores, group, len, v_scale, shape, softmax_rows);
  // pass 2
  int64_t d0 = 0;
  for (; d0 + 64 <= head_dim; d0 += 64) weighted_values<4>(v_head, table, len, block_size, head_dim, d0, group, scores, out);
  if (head_dim - d0 == 32) weighted_values<2>(v_head, table, len, block_size, head_dim, d0, group, scores, out);
}
#else
constexpr bool kHasBf16Kernel = false;
#endif

#if !(defined(__AVX512BF16__) && defined(__AVX512F__)) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGODA_AVX2_DECODE 1
constexpr bool kHasAvx2Kernel = true;

// One (token, kv head) work item in fp32 on 8-lane registers, for every q dtype and cache (model dtype
// or fp8), head_dim % 8 == 0 and block_size % 8 == 0: the AVX-512 BF16 item's structure at half width,
// with the 16-bit and fp8 values widened in registers (bf16: zero-extend and shift left 16; fp16 and
// fp8 through vcvtph2ps).

using pagoda_attention::exp2_8;
using pagoda_attention::load8;
using pagoda_attention::max8;
using pagoda_attention::store8;
using pagoda_attention::sum8;

inline __m256 load8(const c10::Float8_e4m3fn* p) {
  // the e4m3 magnitude shifted into an fp16 is the value times 2^-8 (see fp8x16_to_float)
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7),
                                    _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8));
  return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.f));
}

// lane r = the sum of the 8 lanes of a[r]
inline __m256 sum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [a0..a3 | a0..a3] half sums
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// softmax_rows 8 scores at a time, the tail of each row scalar
inline void softmax_rows_x8(float* scores, int64_t rows, int64_t len, float out_scale) {
  const int64_t len8 = len / 8 * 8;
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * len;
    __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < len8; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + i));
    float m = max8(mv);
    for (int64_t i = len8; i < len; ++i) m = std::max(m, sg[i]);
    const __m256 mx = _mm256_set1_ps(m);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    __m256 sv = _mm256_setzero_ps();
    for (int64_t i = 0; i < len8; i += 8) {
      // exp(x) = 2^(x log2 e); exp_approx's arithmetic (below -87, about 2^-126)
      const __m256 e = exp2_8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(sg + i), mx), log2e));
      _mm256_storeu_ps(sg + i, e);
      sv = _mm256_add_ps(sv, e);
    }
    float sum = sum8(sv);
    for (int64_t i = len8; i < len; ++i) {
      sg[i] = exp_approx(sg[i] - m);
      sum += sg[i];
    }
    const float inv = out_scale / sum;
    const __m256 iv = _mm256_set1_ps(inv);
    for (int64_t i = 0; i < len8; i += 8) _mm256_storeu_ps(sg + i, _mm256_mul_ps(_mm256_loadu_ps(sg + i), iv));
    for (int64_t i = len8; i < len; ++i) sg[i] *= inv;
  }
}

// out[g0 + g, d0 : d0 + 8 * NS] for GH heads = sum_j p[g, j] * V[j, same slice], the GH x NS sums in registers
template <int NS, int GH, typename cache_t, typename scalar_t>
void weighted_values_x8(const cache_t* v_head, const int32_t* table, int64_t len, int64_t block_size,
                        int64_t head_dim, int64_t d0, int64_t g0, const float* probs, scalar_t* out) {
  __m256 acc[GH][NS];
  for (int g = 0; g < GH; ++g)
    for (int s = 0; s < NS; ++s) acc[g][s] = _mm256_setzero_ps();
  for (int64_t start = 0; start < len; start += block_size) {
    const cache_t* v_block = v_head + static_cast<int64_t>(table[start / block_size]) * block_size * head_dim + d0;
    const int64_t n = std::min<int64_t>(block_size, len - start);
    const float* p_row = probs + g0 * len + start;
    for (int64_t j = 0; j < n; ++j) {
      __m256 v[NS];
      for (int s = 0; s < NS; ++s) v[s] = load8(v_block + j * head_dim + 8 * s);
      for (int g = 0; g < GH; ++g) {
        const __m256 p = _mm256_broadcast_ss(p_row + g * len + j);
        for (int s = 0; s < NS; ++s) acc[g][s] = _mm256_fmadd_ps(p, v[s], acc[g][s]);
      }
    }
  }
  for (int g = 0; g < GH; ++g)
    for (int s = 0; s < NS; ++s) store8(out + (g0 + g) * head_dim + d0 + 8 * s, acc[g][s]);
}

// every head of the group over one slice of head_dim, two heads at a time (8 sums + 4 values in registers)
template <int NS, typename cache_t, typename scalar_t>
void weighted_values_slice(const cache_t* v_head, const int32_t* table, int64_t len, int64_t block_size,
                           int64_t head_dim, int64_t d0, int64_t group, const float* probs, scalar_t* out) {
  int64_t g0 = 0;
  for (; g0 + 2 <= group; g0 += 2)
    weighted_values_x8<NS, 2>(v_head, table, len, block_size, head_dim, d0, g0, probs, out);
  if (g0 < group) weighted_values_x8<NS, 1>(v_head, table, len, block_size, head_dim, d0, g0, probs, out);
}

template <typename scalar_t, typename cache_t>
void decode_item_avx2(const scalar_t* q, int64_t q_stride_h, int64_t group, const cache_t* k_head,
                      const cache_t* v_head, const int32_t* table, int64_t len, int64_t block_size, int64_t head_dim,
                      float qk_scale, float v_scale, const ScoreShape& shape, float* qf, float* scores,
                      scalar_t* out) {
  // the group's query rows in fp32, times the score scale: [group, head_dim]
  const __m256 scale = _mm256_set1_ps(qk_scale);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; d += 8)
      _mm256_storeu_ps(qf + g * head_dim + d, _mm256_mul_ps(load8(q + g * q_stride_h + d), scale));
  // pass 1: scores [group, len], 8 key rows at a time (a tile of 8 never crosses a block)
  alignas(32) float tile_scores[8];
  for (int64_t start = 0; start < len; start += 8) {
    const int64_t n = std::min<int64_t>(8, len - start);
    const int64_t offset = (static_cast<int64_t>(table[start / block_size]) * block_size + start % block_size) * head_dim;
    const cache_t* rows = k_head + offset;
    if (start + 8 < len) {  // the next tile's key and value rows: blocks are scattered, the prefetcher cannot guess
      const int64_t next = start + 8;
      const int64_t ahead = (static_cast<int64_t>(table[next / block_size]) * block_size + next % block_size) * head_dim;
      for (int64_t b = 0; b < 8 * head_dim * static_cast<int64_t>(sizeof(cache_t)); b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(k_head + ahead) + b, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v_head + ahead) + b, _MM_HINT_T1);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      // all 8 rows, a compile-time count, so the sums stay in registers; lanes past `n` are not stored
      __m256 acc[8];
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
      const float* qg = qf + g * head_dim;
      for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
        for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(load8(rows + r * head_dim + d), qv, acc[r]);
      }
      _mm256_store_ps(tile_scores, sum8x8(acc));
      std::memcpy(scores + g * len + start, tile_scores, sizeof(float) * n);
    }
  }
  shaped_softmax(scores, group, len, v_scale, shape, softmax_rows_x8);
  // pass 2: 32 dims at a time, then 8
  int64_t d0 = 0;
  for (; d0 + 32 <= head_dim; d0 += 32)
    weighted_values_slice<4>(v_head, table, len, block_size, head_dim, d0, group, scores, out);
  for (; d0 < head_dim; d0 += 8) weighted_values_slice<1>(v_head, table, len, block_size, head_dim, d0, group, scores, out);
}
#else
constexpr bool kHasAvx2Kernel = false;
#endif

// scalar_t: q and out; cache_t: the stored K/V (scalar_t, or c10::Float8_e4m3fn)
template <typename scalar_t, typename cache_t>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                          const at::Tensor& token_req, const at::Tensor& token_len, at::Tensor& out, double scale,
                          double k_scale, double v_scale, int64_t window, double softcap, const float* sinks) {
  // q, out: [T, H, D]; block_tables: [B, max_blocks] int32; token_req / token_len: [T] int32
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* k_ptr = reinterpret_cast<const cache_t*>(kv_cache.data_ptr());
  const cache_t* v_ptr = k_ptr + num_kv_heads * num_blocks * block_size * head_dim;
  const int32_t* bt_ptr = block_tables.data_ptr<int32_t>();
  const int32_t* req_ptr = token_req.data_ptr<int32_t>();
  const int32_t* len_ptr = token_len.data_ptr<int32_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t q_stride_t = q.stride(0), q_stride_h = q.stride(1);
  const int64_t head_stride = num_blocks * block_size * head_dim;  // between kv heads
  const int64_t block_stride = block_size * head_dim;
  const float fscale = static_cast<float>(scale * k_scale);  // the stored keys times k_scale
  const float fv_scale = static_cast<float>(v_scale);
  // the bf16 fast path's shapes (anything else takes the generic loops below)
  const bool bf16_fast = kHasBf16Kernel && head_dim % 32 == 0 && block_size % 16 == 0 && group <= 8 &&
                         q.stride(2) == 1;

  // the AVX2 path's shapes (the generic loops take the rest)
  const bool avx2_fast = kHasAvx2Kernel && head_dim % 8 == 0 && block_size % 8 == 0 && q.stride(2) == 1;

  // the threads take the next (token, kv head) item as they finish the last: items differ in cost by their
  // context length, and a thread the OS holds up then computes fewer instead of making the others wait
  const int64_t num_items = num_tokens * num_kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t item = next++; item < num_items; item = next++) {
      const int64_t t = item / num_kv_heads, h = item % num_kv_heads;
      int64_t len = len_ptr[t];
      if (len <= 0) continue;  // left to the caller (fresh prefills use SDPA)
      const int32_t* table = bt_ptr + static_cast<int64_t>(req_ptr[t]) * max_blocks;
      ScoreShape shape{0, static_cast<float>(softcap), sinks == nullptr ? nullptr : sinks + h * group};
      if (window > 0 && len > window) {
        // the token at position len - 1 sees keys [len - window, len): whole blocks before them are skipped,
        // the rest of the first block's keys masked
        const int64_t skip = (len - window) / block_size * block_size;
        table += skip / block_size;
        len -= skip;
        shape.masked = len - window;
      }
#if defined(__AVX512BF16__) && defined(__AVX512F__)
      if constexpr (std::is_same_v<scalar_t, at::BFloat16> &&
                    (std::is_same_v<cache_t, at::BFloat16> || std::is_same_v<cache_t, c10::Float8_e4m3fn>)) {
        if (bf16_fast && (std::is_same_v<cache_t, at::BFloat16> || head_dim <= kMaxFp8HeadDim)) {
          scores.resize(group * len);
          decode_item_bf16(q_ptr + t * q_stride_t + h * group * q_stride_h, q_stride_h, group, k_ptr + h * head_stride,
                           v_ptr + h * head_stride, table, len, block_size, head_dim, fscale, fv_scale, shape, scores.data(),
                           out_ptr + (t * num_heads + h * group) * head_dim);
          continue;
        }
      }
#endif
#ifdef PAGODA_AVX2_DECODE
      if (avx2_fast) {
        scores.resize(group * len);
        decode_item_avx2(q_ptr + t * q_stride_t + h * group * q_stride_h, q_stride_h, group, k_ptr + h * head_stride,
                         v_ptr + h * head_stride, table, len, block_size, head_dim, fscale, fv_scale, shape, qf.data(),
                         scores.data(), out_ptr + (t * num_heads + h * group) * head_dim);
        continue;
      }
#endif
      for (int64_t g = 0; g < group; ++g) {
        load_row(q_ptr + t * q_stride_t + (h * group + g) * q_stride_h, qf.data() + g * head_dim, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] *= fscale;
      }
      scores.resize(group * len);
      const cache_t* k_head = k_ptr + h * head_stride;
      const cache_t* v_head = v_ptr + h * head_stride;
      // pass 1: scores [group, len]
      for (int64_t start = 0; start < len; start += block_size) {
        const cache_t* k_block = k_head + static_cast<int64_t>(table[start / block_size]) * block_stride;
        const int64_t n = std::min<int64_t>(block_size, len - start);
        for (int64_t j = 0; j < n; ++j) {
          load_row(k_block + j * head_dim, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * head_dim;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * row[d];
            scores[g * len + start + j] = s;
          }
        }
      }
      shaped_softmax(scores.data(), group, len, fv_scale, shape, softmax_rows);  // the stored values times v_scale
      // pass 2: weighted sum of V rows
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const cache_t* v_block = v_head + static_cast<int64_t>(table[start / block_size]) * block_stride;
        const int64_t n = std::min<int64_t>(block_size, len - start);
        for (int64_t j = 0; j < n; ++j) {
          load_row(v_block + j * head_dim, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * len + start + j];
            float* ag = acc.data() + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        store_row(acc.data() + g * head_dim, out_ptr + (t * num_heads + h * group + g) * head_dim, head_dim);
      }
    }
  });
}

}  // namespace

// Each query token t attends to the first token_len[t] positions of request token_req[t] (with window > 0,
// the last `window` of them), its scores soft-capped (softcap > 0: tanh(s / softcap) * softcap) and, given
// sinks ([num_heads] float32), each head's sink logit in its softmax's denominator.
// The cache is q's dtype, or float8_e4m3fn; read values are stored * k_scale (keys), stored * v_scale (values).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& token_req, const at::Tensor& token_len, double scale, double k_scale,
                           double v_scale, int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(q.stride(2) == 1, "q rows must be contiguous in head_dim");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && token_req.scalar_type() == at::kInt &&
                  token_len.scalar_type() == at::kInt,
              "block_tables, token_req and token_len must be int32");
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || q.scalar_type() == kv_cache.scalar_type(), "kv_cache must be q's dtype or float8_e4m3fn");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const auto tables = block_tables.contiguous(), reqs = token_req.contiguous(), lens = token_len.contiguous();
  at::Tensor sink_values;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->numel() == q.size(1),
                "sinks must be float32 with one value per query head");
    sink_values = sinks->contiguous();
  }
  const float* sink_ptr = sinks.has_value() ? sink_values.data_ptr<float>() : nullptr;
  switch (q.scalar_type()) {
    case at::kFloat:
      if (fp8) {
        paged_attention_impl<float, c10::Float8_e4m3fn>(q, kv_cache, tables, reqs, lens, out, scale, k_scale, v_scale,
            window, softcap, sink_ptr);
      } else {
        paged_attention_impl<float, float>(q, kv_cache, tables, reqs, lens, out, scale, k_scale, v_scale,
            window, softcap, sink_ptr);
      }
      break;
    case at::kBFloat16:
      if (fp8) {
        paged_attention_impl<at::BFloat16, c10::Float8_e4m3fn>(q, kv_cache, tables, reqs, lens, out, scale, k_scale,
                                                               v_scale, window, softcap, sink_ptr);
      } else {
        paged_attention_impl<at::BFloat16, at::BFloat16>(q, kv_cache, tables, reqs, lens, out, scale, k_scale,
                                                         v_scale, window, softcap, sink_ptr);
      }
      break;
    case at::kHalf:
      if (fp8) {
        paged_attention_impl<at::Half, c10::Float8_e4m3fn>(q, kv_cache, tables, reqs, lens, out, scale, k_scale,
                                                           v_scale, window, softcap, sink_ptr);
      } else {
        paged_attention_impl<at::Half, at::Half>(q, kv_cache, tables, reqs, lens, out, scale, k_scale, v_scale,
            window, softcap, sink_ptr);
      }
      break;
    default:
      TORCH_CHECK(false, "paged_attention supports float32, bfloat16 and float16, not ", q.scalar_type());
  }
  return out;
}

// Stores k, v [T, Hkv, D] (rows contiguous in D, the cache's dtype) into flat slots [T] of a
// [2, Hkv, num_blocks, block_size, D] cache: one row copy per (token, kv head), in parallel.
void write_kv(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(kv_cache.is_contiguous() && k.stride(2) == 1 && v.stride(2) == 1, "K/V rows must be contiguous");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(),
              "k and v must already be in the cache's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0), "slots must be int64, one per token");
  const int64_t tokens = k.size(0), num_kv_heads = kv_cache.size(1), head_dim = kv_cache.size(4);
  const int64_t slots_per_head = kv_cache.size(2) * kv_cache.size(3);
  const int64_t row_bytes = head_dim * kv_cache.element_size();
  char* k_cache = static_cast<char*>(kv_cache.data_ptr());
  char* v_cache = k_cache + num_kv_heads * slots_per_head * row_bytes;
  const char* k_ptr = static_cast<const char*>(k.data_ptr());
  const char* v_ptr = static_cast<const char*>(v.data_ptr());
  const int64_t elem = k.element_size();
  const auto slot_c = slots.contiguous();
  const int64_t* slot = slot_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots_per_head, "slot ", slot[t], " is outside the cache");
  }
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = (h * slots_per_head + slot[t]) * row_bytes;
        std::memcpy(k_cache + dst, k_ptr + (t * k.stride(0) + h * k.stride(1)) * elem, row_bytes);
        std::memcpy(v_cache + dst, v_ptr + (t * v.stride(0) + h * v.stride(1)) * elem, row_bytes);
      }
    }
  });
}

// whether bf16 caches take decode_item_bf16 (head_dim % 32 == 0, block_size % 16 == 0, group <= 8)
bool has_bf16_kernel() { return kHasBf16Kernel; }

// whether other decodes take decode_item_avx2 (head_dim % 8 == 0, block_size % 8 == 0)
bool has_avx2_kernel() { return kHasAvx2Kernel; }

// every kernel runs without the GIL: a server's event loop and tokenizer thread go on while a step
// computes (the arguments are converted before the call and the result after it, both with the GIL)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const pybind11::call_guard<pybind11::gil_scoped_release> no_gil{};
  m.def("write_kv", &write_kv, "store this step's K/V rows into their cache slots", no_gil);
  m.def("has_bf16_kernel", &has_bf16_kernel, "whether the AVX-512 BF16 decode path was built");
  m.def("has_avx2_kernel", &has_avx2_kernel, "whether the AVX2 decode path (fp32 math, every dtype) was built");
  m.def("paged_attention", &paged_attention, "paged attention over K/V read in place (CPU)", no_gil,
        pybind11::arg("q"), pybind11::arg("kv_cache"), pybind11::arg("block_tables"), pybind11::arg("token_req"),
        pybind11::arg("token_len"), pybind11::arg("scale"), pybind11::arg("k_scale") = 1.0,
        pybind11::arg("v_scale") = 1.0, pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0,
        pybind11::arg("sinks") = pybind11::none());
}
