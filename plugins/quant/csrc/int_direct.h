// The direct path of pagoda's int / MXFP4 / FP8 linears (few activation rows): a tile of output rows dotted with
// the activations in registers straight from the packed codes, per segment of columns, the group's scale applied
// to each partial sum (see the top of cpu_int_kernels.cpp). A portable scalar loop, fp32 FMAs on AVX-512 and on
// AVX2, AVX512-BF16 dot products, the batch-1 4-bit kernels that read both nibbles of a byte in one pass, and
// pick_tile, which chooses a tile function by the tile's shape.
//
// Part of the one translation unit cpu_int_kernels.cpp (its definitions are internal to that build, in an unnamed
// namespace); the build's name covers this file's text, so an edit here builds the kernel anew.
#pragma once

#include "int_codes.h"

namespace {

// What every tile reads: the packed rows, the activations prepared once per call, the segments.
struct Problem {
  const uint8_t* w_q;      // [rows, row_bytes], already offset to the first row of the part
  int64_t row_bytes;
  const float* xf;         // [M, in] fp32 activations (fp32 / fp16 models and the scalar path)
  const uint16_t* xb;      // [M, in] bf16 bits of the activations (bf16 models)
  int64_t in_features;
  const std::vector<Segment>* segs;
  int64_t num_groups;
};

// ---- scalar reference path: out[m * nt + r] = sum_seg scale * sum q * x ----
void dot_tile_scalar(const Problem& p, int64_t n0, int nt, int64_t m0, int mt, const float* scale, float* out) {
  for (int r = 0; r < nt; ++r) {
    const uint8_t* row = p.w_q + (n0 + r) * p.row_bytes;
    for (int m = 0; m < mt; ++m) {
      const float* x = p.xf + (m0 + m) * p.in_features;
      float total = 0.f;
      for (const Segment& s : *p.segs) {
        float acc = 0.f;
        for (int64_t i = 0; i < s.len; ++i) acc += x[s.col + i] * code_at(row, s, i);
        total += acc * scale[r * p.num_groups + s.group];
      }
      out[m * nt + r] = total;
    }
  }
}

#ifdef PAGODA_AVX512
// fp32 FMAs over one segment for NT rows x MT activation rows
template <int NT, int MT, int KIND>
inline void segment_f32(const Problem& p, const Segment& s, const uint8_t* rows, const float* x, __m512 (&acc)[NT][MT]) {
  for (int64_t c = 0; c < s.len; c += 16) {
    const __mmask16 mk = mask16(s.len - c);
    __m512 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm512_maskz_loadu_ps(mk, x + m * p.in_features + s.col + c);
    for (int r = 0; r < NT; ++r) {
      const __m512 w = ints_f32<KIND>(rows + r * p.row_bytes + s.byte + c, mk);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_fmadd_ps(w, xv[m], acc[r][m]);
    }
  }
}

// NT weight rows (from n0) against MT activation rows: per segment, its sums (``segment(s, rows, acc)``, into
// zeroed accumulators) times the segment's group scale, added up; then each lane sum to out[m * NT + r]
template <int NT, int MT, typename SegmentSums>
inline void dot_tile_scaled(const Problem& p, int64_t n0, const float* scale, float* out, const SegmentSums& segment) {
  __m512 acc[NT][MT], tot[NT][MT];
  for (int r = 0; r < NT; ++r)
    for (int m = 0; m < MT; ++m) tot[r][m] = _mm512_setzero_ps();
  const uint8_t* rows = p.w_q + n0 * p.row_bytes;
  for (const Segment& s : *p.segs) {
    for (int r = 0; r < NT; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
    segment(s, rows, acc);
    for (int r = 0; r < NT; ++r) {
      const __m512 sc = _mm512_set1_ps(scale[r * p.num_groups + s.group]);
      for (int m = 0; m < MT; ++m) tot[r][m] = _mm512_fmadd_ps(acc[r][m], sc, tot[r][m]);
    }
  }
  for (int r = 0; r < NT; ++r)
    for (int m = 0; m < MT; ++m) out[m * NT + r] = _mm512_reduce_add_ps(tot[r][m]);
}

template <int NT, int MT>
void dot_tile_f32(const Problem& p, int64_t n0, int64_t m0, const float* scale, float* out) {
  const float* x = p.xf + m0 * p.in_features;
  dot_tile_scaled<NT, MT>(p, n0, scale, out, [&](const Segment& s, const uint8_t* rows, __m512 (&acc)[NT][MT]) {
    with_kind(s.kind, [&](auto kind) { segment_f32<NT, MT, decltype(kind)::value>(p, s, rows, x, acc); });
  });
}
#endif

#ifdef PAGODA_AVX2
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// fp32 FMAs over one segment for NT rows x MT activation rows: 8 columns at a time, the tail scalar
template <int NT, int MT, int KIND>
inline void segment_f32_x8(const Problem& p, const Segment& s, const uint8_t* rows, const float* x,
                           __m256 (&acc)[NT][MT], float (&tail)[NT][MT]) {
  const int64_t len8 = s.len / 8 * 8;
  for (int64_t c = 0; c < len8; c += 8) {
    __m256 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(x + m * p.in_features + s.col + c);
    for (int r = 0; r < NT; ++r) {
      const __m256 w = ints8_f32<KIND>(rows + r * p.row_bytes + s.byte + c);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_fmadd_ps(w, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < NT; ++r) {
    const uint8_t* row = rows + r * p.row_bytes;
    for (int m = 0; m < MT; ++m) {
      float t = 0.f;
      for (int64_t c = len8; c < s.len; ++c)
        t += x[m * p.in_features + s.col + c] * code_at(row, s, c);
      tail[r][m] = t;
    }
  }
}

template <int NT, int MT>
void dot_tile_f32_x8(const Problem& p, int64_t n0, int64_t m0, const float* scale, float* out) {
  __m256 acc[NT][MT], tot[NT][MT];
  float tail[NT][MT], tail_tot[NT][MT] = {};
  for (int r = 0; r < NT; ++r)
    for (int m = 0; m < MT; ++m) tot[r][m] = _mm256_setzero_ps();
  const uint8_t* rows = p.w_q + n0 * p.row_bytes;
  const float* x = p.xf + m0 * p.in_features;
  for (const Segment& s : *p.segs) {
    for (int r = 0; r < NT; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
    with_kind(s.kind, [&](auto kind) { segment_f32_x8<NT, MT, decltype(kind)::value>(p, s, rows, x, acc, tail); });
    for (int r = 0; r < NT; ++r) {
      const float sc = scale[r * p.num_groups + s.group];
      const __m256 scv = _mm256_set1_ps(sc);
      for (int m = 0; m < MT; ++m) {
        tot[r][m] = _mm256_fmadd_ps(acc[r][m], scv, tot[r][m]);
        tail_tot[r][m] += tail[r][m] * sc;
      }
    }
  }
  for (int r = 0; r < NT; ++r)
    for (int m = 0; m < MT; ++m) out[m * NT + r] = sum8(tot[r][m]) + tail_tot[r][m];
}

// Batch 1, 4-bit, fp32 math: one 8-byte load feeds both nibbles (columns c and c + row_bytes), so
// each byte is loaded and widened once (the segment loop reads it twice). Needs row_bytes and the
// group size to be multiples of 8 (no chunk straddles a group); x is [2 * row_bytes], zero past
// in_features. A group cut by the halves' boundary is scaled once per half.
template <int NT, bool FP4>
void dot_rows_paired_x8(const uint8_t* rows, int64_t row_bytes, const float* x, int64_t group_size,
                        int64_t num_groups, const float* scale, float* out) {
  __m256 lo[NT], hi[NT], tot[NT];
  for (int r = 0; r < NT; ++r) lo[r] = hi[r] = tot[r] = _mm256_setzero_ps();
  const __m256i low_nibble = _mm256_set1_epi32(0xF);
  for (int64_t c = 0; c < row_bytes;) {
    // the next end of a group among the low nibbles (columns c...) and among the high ones (c + row_bytes...)
    const int64_t lo_stop = std::min(row_bytes, (c / group_size + 1) * group_size);
    const int64_t hi_stop = std::min(row_bytes, ((c + row_bytes) / group_size + 1) * group_size - row_bytes);
    const int64_t stop = std::min(lo_stop, hi_stop);
    for (; c < stop; c += 8) {
      const __m256 xl = _mm256_loadu_ps(x + c), xh = _mm256_loadu_ps(x + row_bytes + c);
      for (int r = 0; r < NT; ++r) {
        const __m256i w =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows + r * row_bytes + c)));
        lo[r] = _mm256_fmadd_ps(values8<FP4>(_mm256_and_si256(w, low_nibble)), xl, lo[r]);
        hi[r] = _mm256_fmadd_ps(values8<FP4>(_mm256_srli_epi32(w, 4)), xh, hi[r]);
      }
    }
    if (c == lo_stop) {
      const int64_t g = (c - 1) / group_size;
      for (int r = 0; r < NT; ++r) {
        tot[r] = _mm256_fmadd_ps(lo[r], _mm256_set1_ps(scale[r * num_groups + g]), tot[r]);
        lo[r] = _mm256_setzero_ps();
      }
    }
    if (c == hi_stop) {
      const int64_t g = (c - 1 + row_bytes) / group_size;
      for (int r = 0; r < NT; ++r) {
        tot[r] = _mm256_fmadd_ps(hi[r], _mm256_set1_ps(scale[r * num_groups + g]), tot[r]);
        hi[r] = _mm256_setzero_ps();
      }
    }
  }
  for (int r = 0; r < NT; ++r) out[r] = sum8(tot[r]);
}
#endif

#ifdef PAGODA_BF16_DOT
template <int NT, int MT, int KIND>
inline void segment_bf16(const Problem& p, const Segment& s, const uint8_t* rows, const uint16_t* x,
                         __m512 (&acc)[NT][MT]) {
  for (int64_t c = 0; c < s.len; c += 32) {
    const __mmask32 mk = mask32(s.len - c);  // masked tails: x is 0 there, so 128 + 0 adds nothing
    __m512i xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm512_maskz_loadu_epi16(mk, x + m * p.in_features + s.col + c);
    for (int r = 0; r < NT; ++r) {
      const __m512i w = ints_bf16<KIND>(rows + r * p.row_bytes + s.byte + c, mk);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], (__m512bh)w, (__m512bh)xv[m]);
    }
  }
}

template <int NT, int MT>
void dot_tile_bf16(const Problem& p, int64_t n0, int64_t m0, const float* scale, float* out) {
  const uint16_t* x = p.xb + m0 * p.in_features;
  dot_tile_scaled<NT, MT>(p, n0, scale, out, [&](const Segment& s, const uint8_t* rows, __m512 (&acc)[NT][MT]) {
    with_kind(s.kind, [&](auto kind) { segment_bf16<NT, MT, decltype(kind)::value>(p, s, rows, x, acc); });
  });
}

// Batch 1, 4-bit: one 32-byte load feeds both nibbles (columns c and c + row_bytes), so each byte
// is read once. Needs row_bytes and the group size to be multiples of 32 (no chunk straddles a
// group); x is [2 * row_bytes], zero past in_features.
template <int NT, bool FP4>
void dot_rows_paired(const uint8_t* rows, int64_t row_bytes, const uint16_t* x, int64_t group_size,
                     int64_t num_groups, const float* scale, float* out) {
  __m512 lo[NT], hi[NT], tot[NT];
  for (int r = 0; r < NT; ++r) lo[r] = hi[r] = tot[r] = _mm512_setzero_ps();
  const __m512i magic = _mm512_set1_epi16(0x4300), low_nibble = _mm512_set1_epi16(0xF);
  for (int64_t c = 0; c < row_bytes; c += 32) {
    const __m512i xl = _mm512_loadu_si512(x + c), xh = _mm512_loadu_si512(x + row_bytes + c);
    for (int r = 0; r < NT; ++r) {
      const __m512i w =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + r * row_bytes + c)));
      const __m512i low = FP4 ? nibbles_bf16<true>(_mm512_and_si512(w, low_nibble))
                              : _mm512_ternarylogic_epi32(w, low_nibble, magic, 0xEA);  // (w & 15) | magic
      lo[r] = _mm512_dpbf16_ps(lo[r], (__m512bh)low, (__m512bh)xl);
      hi[r] = _mm512_dpbf16_ps(hi[r], (__m512bh)nibbles_bf16<FP4>(_mm512_srli_epi16(w, 4)), (__m512bh)xh);
    }
    const int64_t next = c + 32;
    if (next % group_size == 0 || next == row_bytes) {  // the low nibbles' group ends here
      const int64_t g = c / group_size;
      for (int r = 0; r < NT; ++r) {
        tot[r] = _mm512_fmadd_ps(lo[r], _mm512_set1_ps(scale[r * num_groups + g]), tot[r]);
        lo[r] = _mm512_setzero_ps();
      }
    }
    if ((next + row_bytes) % group_size == 0 || next == row_bytes) {  // and the high nibbles' group
      const int64_t g = (c + row_bytes) / group_size;
      for (int r = 0; r < NT; ++r) {
        tot[r] = _mm512_fmadd_ps(hi[r], _mm512_set1_ps(scale[r * num_groups + g]), tot[r]);
        hi[r] = _mm512_setzero_ps();
      }
    }
  }
  for (int r = 0; r < NT; ++r) out[r] = _mm512_reduce_add_ps(tot[r]);
}
#endif

using TileFn = void (*)(const Problem&, int64_t, int64_t, const float*, float*);

// The tile function for nt rows x mt activation rows, or nullptr for the scalar path.
TileFn pick_tile(bool bf16, int nt, int mt) {
#define PAGODA_TILE(FN, NT_)                                                                   \
  switch (mt) {                                                                                \
    case 1: return &FN<NT_, 1>;                                                                \
    case 2: return &FN<NT_, 2>;                                                                \
    case 3: return &FN<NT_, 3>;                                                                \
    case 4: return &FN<NT_, 4>;                                                                \
    default: return nullptr;                                                                   \
  }
#ifdef PAGODA_BF16_DOT
  if (bf16) {
    if (nt == 8 && mt == 1) return &dot_tile_bf16<8, 1>;
    if (nt == 4 && mt < 4) { PAGODA_TILE(dot_tile_bf16, 4) }
    if (nt == 2) { PAGODA_TILE(dot_tile_bf16, 2) }
    if (nt == 1) { PAGODA_TILE(dot_tile_bf16, 1) }
    return nullptr;
  }
#endif
#ifdef PAGODA_AVX2
  // at most 6 sums and 6 running totals in the 16 registers
  if (nt == 4 && mt == 1) return &dot_tile_f32_x8<4, 1>;
  if (nt == 2 && mt <= 3) { PAGODA_TILE(dot_tile_f32_x8, 2) }
  if (nt == 1) { PAGODA_TILE(dot_tile_f32_x8, 1) }
#endif
#ifdef PAGODA_AVX512
  if (nt == 8 && mt == 1) return &dot_tile_f32<8, 1>;
  if (nt == 4 && mt < 4) { PAGODA_TILE(dot_tile_f32, 4) }
  if (nt == 2) { PAGODA_TILE(dot_tile_f32, 2) }
  if (nt == 1) { PAGODA_TILE(dot_tile_f32, 1) }
#endif
  (void)bf16;
  return nullptr;
#undef PAGODA_TILE
}

// tiles of rows to prefetch ahead of the one being multiplied
constexpr int64_t kPrefetchTiles = 2;

inline void prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

}  // namespace
