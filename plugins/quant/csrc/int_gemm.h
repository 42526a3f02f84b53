// The GEMM path of pagoda's int / MXFP4 / FP8 linears (many activation rows): tiles of rows dequantized into the
// model dtype, bit for bit what the torch path builds, and multiplied by torch's GEMM (run_gemm); on AVX2, where
// torch has no fast bf16 GEMM, bf16 tiles widened to fp32 per thread for an fp32 GEMM (run_gemm_widened).
//
// Part of the one translation unit cpu_int_kernels.cpp (its definitions are internal to that build, in an unnamed
// namespace); the build's name covers this file's text, so an edit here builds the kernel anew.
#pragma once

#include <ATen/ThreadLocalState.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>

#include "int_codes.h"

namespace {

// ---- dequantization of a tile of rows, for the GEMM path of large batches ----
// W[o, c] rounded to the model dtype once, exactly as (v(q) - zero) * scale computed in fp32 and
// converted (what the torch path computes in the model dtype). 4-bit segments go through a
// 16-entry table per (row, group): one permute per 32 columns instead of a convert, sub and mul.

#ifdef PAGODA_AVX512
// fp32 -> bf16 bits, round to nearest even like c10::BFloat16 (NaN aside; scales and weights are finite)
inline __m256i bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
#endif

#ifdef PAGODA_AVX2
// 8 fp32 values stored as T, round to nearest even (what static_cast<T> of each does; pagoda_vec8.h)
using pagoda::store8;

// dequantize_row's (v(q) - zero) * scale, 8 columns at a time; returns the columns done
template <typename T>
inline int64_t dequantize_segment_x8(const uint8_t* row, const Segment& s, float z, float sc, T* dst) {
  const __m256 zv = _mm256_set1_ps(z), scv = _mm256_set1_ps(sc);
  const int64_t len8 = s.len / 8 * 8;
  for (int64_t i = 0; i < len8; i += 8) {
    const uint8_t* src = row + s.byte + i;
    __m256 q;
    with_kind(s.kind, [&](auto kind) { q = ints8_f32<decltype(kind)::value>(src); });
    store8(dst + i, _mm256_mul_ps(_mm256_sub_ps(q, zv), scv));
  }
  return len8;
}
#endif

template <typename T>
void dequantize_row(const uint8_t* row, const std::vector<Segment>& segs, const float* scale, const float* zero,
                    T* out, bool vector) {
  for (const Segment& s : segs) {
    const float sc = scale[s.group], z = zero[s.group];
    T* dst = out + s.col;
#ifdef PAGODA_AVX2
    if (vector) {
      const int64_t done = dequantize_segment_x8<T>(row, s, z, sc, dst);
      for (int64_t i = done; i < s.len; ++i) dst[i] = static_cast<T>((code_at(row, s, i) - z) * sc);
      continue;
    }
#endif
    if (s.kind == kByte8) {
      for (int64_t i = 0; i < s.len; ++i) dst[i] = static_cast<T>((static_cast<float>(row[s.byte + i]) - z) * sc);
      continue;
    }
    if (s.kind == kByteFp8) {
      int64_t i = 0;
#ifdef PAGODA_AVX512
      for (; vector && i + 16 <= s.len; i += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_sub_ps(ints_f32<kByteFp8>(row + s.byte + i, 0xFFFF), _mm512_set1_ps(z)),
                                       _mm512_set1_ps(sc));
        for (int k = 0; k < 16; ++k) dst[i + k] = static_cast<T>(v[k]);
      }
#endif
      for (; i < s.len; ++i) dst[i] = static_cast<T>((code_at(row, s, i) - z) * sc);
      continue;
    }
    int64_t i = 0;
#ifdef PAGODA_AVX512
    if (vector) {
      // the table: (v(q) - zero) * scale for q = 0..15, rounded to T as the scalar conversion does (RNE)
      const __m512 value =
          _mm512_mul_ps(_mm512_sub_ps(nibble_values(is_fp4(s.kind)), _mm512_set1_ps(z)), _mm512_set1_ps(sc));
      if (sizeof(T) == 2) {
        const __m256i half = std::is_same<T, at::Half>::value
                                 ? _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#ifdef PAGODA_BF16_DOT
                                 // one instruction, also round-to-nearest-even (it flushes subnormals,
                                 // which (v(q) - zero) * scale of a real checkpoint never is)
                                 : (__m256i)_mm512_cvtneps_pbh(value);
#else
                                 : bf16_bits(value);
#endif
        const __m512i table = _mm512_castsi256_si512(half);  // indices stay below 16
        for (; i < s.len; i += 32) {
          const __mmask32 mk = mask32(s.len - i);
          __m512i w = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mk, row + s.byte + i));
          w = is_low(s.kind) ? _mm512_and_si512(w, _mm512_set1_epi16(0xF)) : _mm512_srli_epi16(w, 4);
          _mm512_mask_storeu_epi16(dst + i, mk, _mm512_permutexvar_epi16(w, table));
        }
      } else {
        for (; i < s.len; i += 16) {
          const __mmask16 mk = mask16(s.len - i);
          __m512i w = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mk, row + s.byte + i));
          w = is_low(s.kind) ? _mm512_and_si512(w, _mm512_set1_epi32(0xF)) : _mm512_srli_epi32(w, 4);
          _mm512_mask_storeu_ps(reinterpret_cast<float*>(dst + i), mk, _mm512_permutexvar_ps(w, value));
        }
      }
    }
#endif
    for (; i < s.len; ++i) dst[i] = static_cast<T>((code_at(row, s, i) - z) * sc);
  }
}

#ifdef PAGODA_BF16_DOT
// bf16 (v(q) - zero) * scale for q = 0..15 in the low 16 words
inline __m512i bf16_table(bool fp4, float zero, float scale) {
  const __m512 v = _mm512_mul_ps(_mm512_sub_ps(nibble_values(fp4), _mm512_set1_ps(zero)), _mm512_set1_ps(scale));
  return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
}

// A 4-bit bf16 row whose halves are aligned to 32 columns (row_bytes and the group size multiples
// of 32): one load per 32 bytes feeds both nibbles, as in dot_rows_paired; same values as
// dequantize_row.
inline void dequantize_row_paired(const uint8_t* row, int64_t row_bytes, int64_t in_features, int64_t group_size,
                                  bool fp4, const float* scale, const float* zero, uint16_t* out) {
  __m512i lo_table = _mm512_setzero_si512(), hi_table = _mm512_setzero_si512();
  int64_t lo_group = -1, hi_group = -1;
  const __m512i low_nibble = _mm512_set1_epi16(0xF);
  for (int64_t c = 0; c < row_bytes; c += 32) {
    const int64_t gl = c / group_size, gh = (c + row_bytes) / group_size;
    if (gl != lo_group) lo_table = bf16_table(fp4, zero[gl], scale[gl]), lo_group = gl;
    if (gh != hi_group) hi_table = bf16_table(fp4, zero[gh], scale[gh]), hi_group = gh;
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c)));
    // columns at or past in_features are padding: not stored (the row is in_features long)
    _mm512_mask_storeu_epi16(out + c, mask32(in_features - c),
                             _mm512_permutexvar_epi16(_mm512_and_si512(w, low_nibble), lo_table));
    _mm512_mask_storeu_epi16(out + row_bytes + c, mask32(in_features - row_bytes - c),
                             _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), hi_table));
  }
}
#endif

// Rows [row_start, row_start + rows) dequantized tile by tile into the model dtype, each tile
// multiplied by the activations with torch's GEMM; the tile buffer is reused (never a full copy).
template <typename T>
void run_gemm(const at::Tensor& x, const uint8_t* w_q, int64_t row_bytes, const GroupScales<T>& sc,
              const std::vector<Segment>& segs, int bits, int64_t group_size, const c10::optional<at::Tensor>& perm,
              int64_t rows, int64_t tile_rows, at::Tensor& y_rows, bool vector) {
  const int64_t G = sc.G;
  const int64_t K = x.size(1);
  const bool paired = vector && std::is_same<T, at::BFloat16>::value && bits == 4 && row_bytes % 32 == 0 &&
                      group_size % 32 == 0;
  const at::Tensor xp = perm.has_value() ? x.index_select(1, *perm) : x;  // [M, in] in packed column order
  at::Tensor tile = at::empty({std::min(tile_rows, rows), K}, x.options());
  T* tp = tile.data_ptr<T>();
  for (int64_t t0 = 0; t0 < rows; t0 += tile_rows) {
    const int64_t n = std::min(tile_rows, rows - t0);
    at::parallel_for(0, n, 8, [&](int64_t r0, int64_t r1) {
      std::vector<float> scale(G), zero(G);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t o = t0 + r;
        sc.row(o, scale.data(), zero.data());
#ifdef PAGODA_BF16_DOT
        if (paired) {
          dequantize_row_paired(w_q + o * row_bytes, row_bytes, K, group_size, sc.fp4(), scale.data(), zero.data(),
                                reinterpret_cast<uint16_t*>(tp + r * K));
          continue;
        }
#endif
        dequantize_row<T>(w_q + o * row_bytes, segs, scale.data(), zero.data(), tp + r * K, vector);
      }
    });
    if (n == y_rows.size(1) && y_rows.is_contiguous()) {
      at::mm_out(y_rows, xp, tile.t());  // one tile covering every output column: no copy
    } else {
      y_rows.narrow(1, t0, n).copy_(at::mm(xp, tile.narrow(0, 0, n).t()));  // [M, n]
    }
  }
}

#ifdef PAGODA_AVX2
// weight rows per thread tile of run_gemm_widened: 128 x in_features fp32 stays in L2 for this
// model's layers (288 KiB at 576 columns), as in the dense gemm_bf16_fp32
constexpr int64_t kWideTileRows = 128;

// The GEMM path for bf16 without bf16 math: y_rows [M, rows] (a column range of y, bias added, one
// bf16 rounding) from fp32 products of the activations and the dequantized rows widened to fp32.
// The weight values are dequantize_row's bf16 ones, so this computes what the torch path's
// dequantized weight gives, up to summation order.
void run_gemm_widened(const at::Tensor& x, const uint8_t* w_q, int64_t row_bytes, const GroupScales<at::BFloat16>& sc,
                      const std::vector<Segment>& segs, const c10::optional<at::Tensor>& perm, int64_t rows,
                      at::Tensor& y_rows, const at::BFloat16* bp) {
  const int64_t M = x.size(0), K = x.size(1), ldy = y_rows.stride(0), G = sc.G;
  // activations in the packed column order, widened once, zero rows up to a multiple of 16 (the fp32
  // GEMM ran 1.5 to 2x slower on 13 to 15, 31 or 47 rows than on 16, 32 or 48): [Mp, K] fp32
  const int64_t Mp = (M + 15) / 16 * 16;
  at::Tensor xf = at::zeros({Mp, K}, x.options().dtype(at::kFloat));
  xf.narrow(0, 0, M).copy_(perm.has_value() ? x.index_select(1, *perm) : x);
  at::BFloat16* yp = y_rows.data_ptr<at::BFloat16>();
  const int64_t num_tiles = (rows + kWideTileRows - 1) / kWideTileRows;
  const at::ThreadLocalState caller_state;  // inference / grad mode, for the tensor ops of the worker threads
  at::parallel_for(0, num_tiles, 1, [&](int64_t first, int64_t last) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    const int64_t max_rows = std::min(kWideTileRows, rows);
    at::Tensor tile = at::empty({max_rows, K}, xf.options());    // dequantized rows, widened
    at::Tensor tile_y = at::empty({max_rows, Mp}, xf.options());  // their outputs, transposed
    float* tp = tile.data_ptr<float>();
    const float* ty = tile_y.data_ptr<float>();
    std::vector<at::BFloat16> row(K);
    std::vector<float> scale(G), zero(G);
    const uint16_t* rb = reinterpret_cast<const uint16_t*>(row.data());
    for (int64_t t = first; t < last; ++t) {
      const int64_t t0 = t * kWideTileRows, n = std::min(kWideTileRows, rows - t0);
      for (int64_t r = 0; r < n; ++r) {
        const int64_t o = t0 + r;
        sc.row(o, scale.data(), zero.data());
        dequantize_row<at::BFloat16>(w_q + o * row_bytes, segs, scale.data(), zero.data(), row.data(), true);
        float* dst = tp + r * K;
        int64_t c = 0;
        for (; c + 8 <= K; c += 8) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rb + c));
          _mm256_storeu_ps(dst + c, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
        }
        for (; c < K; ++c) dst[c] = static_cast<float>(row[c]);
      }
      at::Tensor out = tile_y.narrow(0, 0, n);
      at::mm_out(out, tile.narrow(0, 0, n), xf.t());  // [n, M]; one thread here: inside a parallel region
      // [n, M] -> columns t0 .. t0 + n of y_rows, while the tile is in cache
      for (int64_t m = 0; m < M; ++m) {
        at::BFloat16* yr = yp + m * ldy + t0;
        for (int64_t r = 0; r < n; ++r)
          yr[r] = static_cast<at::BFloat16>(ty[r * Mp + m] + (bp ? to_float(bp[t0 + r]) : 0.f));
      }
    }
  });
}
#endif

}  // namespace
