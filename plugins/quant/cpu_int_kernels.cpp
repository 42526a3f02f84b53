// Group-wise int4 / int8 and MXFP4 linear layers for x86 CPUs, computed straight from pagoda's packed layout.
//
// Layout (see int_linear.py and packing.py): w_q uint8 [out, bytes]; 8-bit: byte c is column c;
// 4-bit: byte c holds column c in its low nibble and column c + bytes in its high nibble. A code q
// has a value v(q) and each group of columns a scale (and a zero point), g = c / group_size:
// - integer codes: v(q) = q, w_scales / w_zeros [out, groups] in the model dtype,
//   W[o, c] = (q - zero[o, g]) * scale[o, g];
// - FP4 (e2m1) codes of MXFP4 (4-bit, groups of 32): v(q) = FP4[q] (0, 0.5, 1, 1.5, 2, 3, 4, 6 and
//   their negatives), w_scales uint8 [out, groups] E8M0 exponents, no zero points,
//   W[o, c] = FP4[q] * 2^(e[o, g] - 127);
// - FP8 (e4m3) codes (8-bit): v(q) = the float8_e4m3fn number q encodes, w_scales [out, groups] in the model
//   dtype, no zero points, W[o, c] = v(q) * scale[o, g].
// y[m, o] = sum_c x[m, perm[c]] * W[o, c] (+ bias[o]). The two differ only where a code becomes its
// value (the segment kinds below) and where a row's scales are read (GroupScales); every loop is shared.
//
// Small batches (the direct path): the weight is never dequantized into memory. Each work item
// takes a tile of output rows and, for every "segment" of columns (one group, read from one nibble of a contiguous byte range), dots
// the codes' values with x in registers; the group's scale multiplies that partial sum once, and
// the zero point is applied at the end through per-group sums of x:
//   y[m, o] = sum_g scale[o, g] * (sum_{c in g} x[m, c] v(q[o, c]) - zero[o, g] * xsum[m, g]).
// With bf16 activations the integers become bf16 (0x4300 | q is exactly 128 + q, so a nibble needs
// one ternary-logic op), FP4 codes their exact bf16 values through a 16-entry table (one vpermw),
// FP8 codes theirs by moving their bits (fp8_bf16), and AVX512-BF16 dot products take 32 columns
// per instruction; fp32 and fp16 activations use fp32 FMAs (integers converted, FP4 codes looked up
// with vpermps, FP8 codes widened through fp16), so their results are exact up to summation order. With AVX2 + FMA (no AVX-512) every dtype computes in fp32 on 8 lanes (an FP4
// code: a vpermps of the 8 magnitudes and its sign bit moved into place), batch 1 at 4 bits reading
// both nibbles of each byte in one pass; elsewhere a portable scalar loop computes the same sums.
//
// Larger batches (the GEMM path, chosen by the caller's gemm_min_rows): tiles of rows are
// dequantized into one reused buffer in the model dtype, bit for bit what the torch path builds,
// and multiplied by torch's GEMM, whose blocking beats register tiles once the dequantization is
// shared by enough activation rows. With AVX2 and no AVX-512, torch has no fast bf16 GEMM: there
// each thread dequantizes 128 rows at a time to the same bf16 values, widens them to fp32 in its
// own buffer and multiplies them by the fp32 activations (run_gemm_widened; what the dense layers'
// gemm_bf16_fp32 does with bf16 weights).

#include "pagoda_torch.h"
#include "pagoda_parallel.h"
#include "pagoda_routing.h"
#include <ATen/ThreadLocalState.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PAGODA_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// no AVX-512: the direct path's fp32 FMAs and the dequantization on 8-lane registers (every activation
// dtype computes in fp32 here; bf16 activations are widened once per call)
#include <immintrin.h>
#define PAGODA_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// What a row's codes are (the caller's `codes` argument)
enum Codes { kIntCodes = 0, kFp4Codes = 1, kFp8Codes = 2 };

// Where a segment's codes sit and what they are: integers in the low or high nibbles or whole bytes, FP4 codes
// in the low or high nibbles, or FP8 codes in whole bytes
enum Kind { kLow4 = 0, kHigh4 = 1, kByte8 = 2, kLowFp4 = 3, kHighFp4 = 4, kByteFp8 = 5 };

constexpr bool is_fp4(int kind) { return kind == kLowFp4 || kind == kHighFp4; }
constexpr bool is_low(int kind) { return kind == kLow4 || kind == kLowFp4; }
constexpr bool is_high(int kind) { return kind == kHigh4 || kind == kHighFp4; }

// f(std::integral_constant<int, kind>): one instantiation per kind for the loops that take it as a template
// argument
template <typename F>
inline void with_kind(int kind, const F& f) {
  switch (kind) {
    case kLow4: f(std::integral_constant<int, kLow4>{}); break;
    case kHigh4: f(std::integral_constant<int, kHigh4>{}); break;
    case kLowFp4: f(std::integral_constant<int, kLowFp4>{}); break;
    case kHighFp4: f(std::integral_constant<int, kHighFp4>{}); break;
    case kByteFp8: f(std::integral_constant<int, kByteFp8>{}); break;
    default: f(std::integral_constant<int, kByte8>{}); break;
  }
}

// FP4 (e2m1) values by code: sign in bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
alignas(64) constexpr float kFp4Values[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                              -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
// the same as bf16 bits (exact), padded to the 32 entries of a vpermw table
alignas(64) constexpr uint16_t kFp4Bf16[32] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                               0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

// Columns [col, col + len) of one group, whose integers sit in bytes [byte, byte + len) as `kind`.
struct Segment {
  int64_t col;
  int64_t len;
  int64_t byte;
  int kind;
  int64_t group;
};

// Cut [0, in_features) at group boundaries and, for 4-bit rows, where the high nibbles begin.
std::vector<Segment> make_segments(int64_t in_features, int64_t row_bytes, int bits, int64_t group_size, int codes) {
  std::vector<Segment> segs;
  const bool fp4 = codes == kFp4Codes;
  for (int64_t c = 0; c < in_features;) {
    const int64_t g = c / group_size;
    int64_t end = std::min(in_features, (g + 1) * group_size);
    Segment s{c, 0, c, codes == kFp8Codes ? kByteFp8 : kByte8, g};
    if (bits == 4) {
      if (c < row_bytes) {
        end = std::min(end, row_bytes);
        s.kind = fp4 ? kLowFp4 : kLow4;
      } else {
        s.kind = fp4 ? kHighFp4 : kHigh4;
        s.byte = c - row_bytes;
      }
    }
    s.len = end - c;
    segs.push_back(s);
    c = end;
  }
  return segs;
}

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(at::Half v) { return static_cast<float>(v); }

// An e4m3 byte's exponent and mantissa moved into an fp16's (sign to sign) are its value times 2^-8, subnormals
// included: the fp16 bits of v(q) / 256
inline uint16_t fp8_as_half_bits(uint8_t q) { return static_cast<uint16_t>(((q & 0x7F) << 7) | ((q & 0x80) << 8)); }

inline float fp8_value(uint8_t q) { return static_cast<float>(c10::Half(fp8_as_half_bits(q), c10::Half::from_bits())) * 256.f; }

// the value of column s.col + i's code
inline float code_at(const uint8_t* row, const Segment& s, int64_t i) {
  const uint8_t b = row[s.byte + i];
  if (s.kind == kByteFp8) return fp8_value(b);
  const uint8_t q = is_low(s.kind) ? (b & 0xF) : is_high(s.kind) ? (b >> 4) : b;
  return is_fp4(s.kind) ? kFp4Values[q] : static_cast<float>(q);
}

// E8M0: 2^(e - 127), built as float bits (e = 0 is 2^-127, a float subnormal; 255, E8M0's NaN, gives infinity)
inline float e8m0_value(uint8_t e) {
  const uint32_t bits = e ? static_cast<uint32_t>(e) << 23 : 0x00400000u;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The per-group scales (and zero points) of a matrix's rows, [rows, G]: in the model dtype T (integer codes with
// zero points, FP8 codes without), or E8M0 exponents (FP4 codes, no zero points)
template <typename T>
struct GroupScales {
  const T* scale;
  const T* zero;            // null: no zero points
  const uint8_t* exponent;  // set for FP4 codes, in place of scale
  int64_t G;

  bool fp4() const { return exponent != nullptr; }
  bool has_zeros() const { return zero != nullptr; }
  GroupScales from_row(int64_t r) const {
    const auto offset = [&](auto* p) { return p ? p + r * G : p; };
    return GroupScales{offset(scale), offset(zero), offset(exponent), G};
  }
  // row o's scales and zero points as fp32
  void row(int64_t o, float* s, float* z) const {
    for (int64_t g = 0; g < G; ++g) {
      s[g] = fp4() ? e8m0_value(exponent[o * G + g]) : to_float(scale[o * G + g]);
      z[g] = has_zeros() ? to_float(zero[o * G + g]) : 0.f;
    }
  }
};

// w_scales / w_zeros as GroupScales: uint8 scales are E8M0 exponents of FP4 codes
template <typename T>
GroupScales<T> group_scales(const at::Tensor& scales, const c10::optional<at::Tensor>& zeros) {
  if (scales.scalar_type() == at::kByte) return {nullptr, nullptr, scales.data_ptr<uint8_t>(), scales.size(-1)};
  return {scales.data_ptr<T>(), zeros.has_value() ? zeros->data_ptr<T>() : nullptr, nullptr, scales.size(-1)};
}

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
inline __mmask16 mask16(int64_t n) { return n <= 0 ? 0 : n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }
inline __mmask32 mask32(int64_t n) { return n <= 0 ? 0 : n >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << n) - 1); }

// fp32 -> bf16 bits, round to nearest even like c10::BFloat16 (NaN aside; scales and weights are finite)
inline __m256i bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// 16 codes (32-bit lanes, each below 16 for FP4) as their fp32 values
template <bool FP4>
inline __m512 values16(__m512i q) {
  return FP4 ? _mm512_permutexvar_ps(q, _mm512_load_ps(kFp4Values)) : _mm512_cvtepi32_ps(q);
}

// 16 FP8 codes (16-bit lanes) as their fp32 values, through fp16 (fp8_as_half_bits)
inline __m512 fp8_values16(__m256i q) {
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(q, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(q, _mm256_set1_epi16(0x80)), 8));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

// 16 codes of a segment as fp32 values (masked-off columns: code 0, value 0)
template <int KIND>
inline __m512 ints_f32(const uint8_t* p, __mmask16 mk) {
  if (KIND == kByteFp8) return fp8_values16(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(mk, p)));
  __m512i w = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mk, p));
  if (is_low(KIND)) w = _mm512_and_si512(w, _mm512_set1_epi32(0xF));
  if (is_high(KIND)) w = _mm512_srli_epi32(w, 4);
  return values16<is_fp4(KIND)>(w);
}

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

template <int NT, int MT>
void dot_tile_f32(const Problem& p, int64_t n0, int64_t m0, const float* scale, float* out) {
  __m512 acc[NT][MT], tot[NT][MT];
  for (int r = 0; r < NT; ++r)
    for (int m = 0; m < MT; ++m) tot[r][m] = _mm512_setzero_ps();
  const uint8_t* rows = p.w_q + n0 * p.row_bytes;
  const float* x = p.xf + m0 * p.in_features;
  for (const Segment& s : *p.segs) {
    for (int r = 0; r < NT; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
    with_kind(s.kind, [&](auto kind) { segment_f32<NT, MT, decltype(kind)::value>(p, s, rows, x, acc); });
    for (int r = 0; r < NT; ++r) {
      const __m512 sc = _mm512_set1_ps(scale[r * p.num_groups + s.group]);
      for (int m = 0; m < MT; ++m) tot[r][m] = _mm512_fmadd_ps(acc[r][m], sc, tot[r][m]);
    }
  }
  for (int r = 0; r < NT; ++r)
    for (int m = 0; m < MT; ++m) out[m * NT + r] = _mm512_reduce_add_ps(tot[r][m]);
}
#endif

#ifdef PAGODA_AVX2
// 8 codes (32-bit lanes, each below 16 for FP4) as their fp32 values: an FP4 code's magnitude from its low 3
// bits (vpermps reads only those), its sign from bit 3
template <bool FP4>
inline __m256 values8(__m256i q) {
  if (!FP4) return _mm256_cvtepi32_ps(q);
  const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_load_ps(kFp4Values), q);
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(q, 28), _mm256_set1_epi32(INT32_MIN));
  return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
}

// 8 codes of a segment as fp32 values (the caller keeps 8 columns inside the segment)
template <int KIND>
inline __m256 ints8_f32(const uint8_t* p) {
  if (KIND == kByteFp8) {  // through fp16 (fp8_as_half_bits)
    const __m128i q = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(q, _mm_set1_epi16(0x7F)), 7),
                                   _mm_slli_epi16(_mm_and_si128(q, _mm_set1_epi16(0x80)), 8));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
  }
  __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if (is_low(KIND)) w = _mm256_and_si256(w, _mm256_set1_epi32(0xF));
  if (is_high(KIND)) w = _mm256_srli_epi32(w, 4);
  return values8<is_fp4(KIND)>(w);
}

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

// 8 fp32 values stored as T, round to nearest even (what static_cast<T> of each does)
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

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

#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)
#define PAGODA_BF16_DOT 1
// 32 4-bit codes (16-bit lanes) as bf16 words: integers as 128 + q (exact), FP4 codes as their values
template <bool FP4>
inline __m512i nibbles_bf16(__m512i q) {
  return FP4 ? _mm512_permutexvar_epi16(q, _mm512_load_si512(kFp4Bf16)) : _mm512_or_si512(q, _mm512_set1_epi16(0x4300));
}

// 32 codes of a segment as bf16 words: 4-bit integers as 128 + q (exact), FP4 codes as their values, 8-bit
// integers converted
// bf16 bits of e4m3's subnormals, m * 2^-9 for m = 0..7, padded to a vpermw table
alignas(64) constexpr uint16_t kFp8SubnormalBf16[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};

// 32 FP8 codes (16-bit lanes) as their exact bf16 values: a normal number's exponent and mantissa moved into
// bf16's and its exponent rebiased (+120), a subnormal (exponent field 0) from a table, the sign moved over
inline __m512i fp8_bf16(__m512i q) {
  const __m512i magnitude = _mm512_and_si512(q, _mm512_set1_epi16(0x7F));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 4), _mm512_set1_epi16(0x3C00));
  const __mmask32 subnormal = _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(8));
  const __m512i bits =
      _mm512_mask_permutexvar_epi16(normal, subnormal, magnitude, _mm512_load_si512(kFp8SubnormalBf16));
  return _mm512_or_si512(bits, _mm512_slli_epi16(_mm512_and_si512(q, _mm512_set1_epi16(0x80)), 8));
}

template <int KIND>
inline __m512i ints_bf16(const uint8_t* p, __mmask32 mk) {
  if (KIND == kByteFp8) return fp8_bf16(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mk, p)));
  if (KIND == kByte8) {
    const __m256i b = _mm256_maskz_loadu_epi8(mk, p);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(b, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // q <= 255 is exact in bf16
  }
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mk, p));
  const __m512i magic = _mm512_set1_epi16(0x4300);  // bf16 128.0: its mantissa steps by 1
  if (KIND == kLow4) return _mm512_ternarylogic_epi32(w, _mm512_set1_epi16(0xF), magic, 0xEA);  // (w & 15) | magic
  if (KIND == kLowFp4) return nibbles_bf16<true>(_mm512_and_si512(w, _mm512_set1_epi16(0xF)));
  return nibbles_bf16<is_fp4(KIND)>(_mm512_srli_epi16(w, 4));
}

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
  __m512 acc[NT][MT], tot[NT][MT];
  for (int r = 0; r < NT; ++r)
    for (int m = 0; m < MT; ++m) tot[r][m] = _mm512_setzero_ps();
  const uint8_t* rows = p.w_q + n0 * p.row_bytes;
  const uint16_t* x = p.xb + m0 * p.in_features;
  for (const Segment& s : *p.segs) {
    for (int r = 0; r < NT; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
    with_kind(s.kind, [&](auto kind) { segment_bf16<NT, MT, decltype(kind)::value>(p, s, rows, x, acc); });
    for (int r = 0; r < NT; ++r) {
      const __m512 sc = _mm512_set1_ps(scale[r * p.num_groups + s.group]);
      for (int m = 0; m < MT; ++m) tot[r][m] = _mm512_fmadd_ps(acc[r][m], sc, tot[r][m]);
    }
  }
  for (int r = 0; r < NT; ++r)
    for (int m = 0; m < MT; ++m) out[m * NT + r] = _mm512_reduce_add_ps(tot[r][m]);
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

// ---- dequantization of a tile of rows, for the GEMM path of large batches ----
// W[o, c] rounded to the model dtype once, exactly as (v(q) - zero) * scale computed in fp32 and
// converted (what the torch path computes in the model dtype). 4-bit segments go through a
// 16-entry table per (row, group): one permute per 32 columns instead of a convert, sub and mul.

#ifdef PAGODA_AVX512
// the values of the 16 4-bit codes: the integers 0..15, or FP4's
inline __m512 nibble_values(bool fp4) {
  return fp4 ? _mm512_load_ps(kFp4Values) : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
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

enum Impl { kAuto = 0, kScalar = 1 };

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

// tiles of rows to prefetch ahead of the one being multiplied
constexpr int64_t kPrefetchTiles = 2;

inline void prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

// y[:, row_start:row_end] = x[:, perm] @ W[row_start:row_end]^T (+ bias[row_start:row_end]) for w_q's rows and
// their scales (FP4 codes where `scales` are E8M0 exponents)
template <typename T>
void run(const at::Tensor& x, const at::Tensor& w_q, const GroupScales<T>& scales, int codes,
         const c10::optional<at::Tensor>& perm, int bits, int64_t group_size, int64_t row_start, int64_t row_end,
         at::Tensor& y, const c10::optional<at::Tensor>& bias, int impl, int64_t gemm_min_rows, int64_t tile_rows) {
  const int64_t M = x.size(0), K = x.size(1), rows = row_end - row_start;
  const int64_t G = scales.G, row_bytes = w_q.size(1), ldy = y.size(1);
  const GroupScales<T> sc = scales.from_row(row_start);
  const std::vector<Segment> segs = make_segments(K, row_bytes, bits, group_size, codes);
  if (M >= gemm_min_rows) {
    at::Tensor y_rows = y.narrow(1, row_start, rows);
#ifdef PAGODA_AVX2
    if constexpr (std::is_same<T, at::BFloat16>::value) {
      if (impl != kScalar) {
        run_gemm_widened(x, w_q.data_ptr<uint8_t>() + row_start * row_bytes, row_bytes, sc, segs, perm, rows, y_rows,
                         bias.has_value() ? bias->data_ptr<T>() + row_start : nullptr);
        return;
      }
    }
#endif
    run_gemm<T>(x, w_q.data_ptr<uint8_t>() + row_start * row_bytes, row_bytes, sc, segs, bits, group_size, perm, rows,
                tile_rows, y_rows, impl != kScalar);
    if (bias.has_value()) y_rows.add_(bias->narrow(0, row_start, rows));
    return;
  }

  // activations in the column order of the packed weight, and their per-group sums (fp32) for the zero points
  const bool has_zeros = sc.has_zeros();
  bool use_bf16 = false;
#ifdef PAGODA_BF16_DOT
  use_bf16 = std::is_same<T, at::BFloat16>::value && impl != kScalar;
#endif
  const T* xs = x.data_ptr<T>();
  const int64_t* pm = perm.has_value() ? perm->data_ptr<int64_t>() : nullptr;
  std::vector<float> xf(use_bf16 ? 0 : M * K);
  std::vector<uint16_t> xb(use_bf16 ? M * K : 0);
  std::vector<float> xsum(has_zeros ? M * G : 0, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = xs + m * K;
    for (int64_t c = 0; c < K; ++c) {
      const T v = xr[pm ? pm[c] : c];
      if (use_bf16) std::memcpy(&xb[m * K + c], &v, sizeof(uint16_t));
      else xf[m * K + c] = to_float(v);
      if (has_zeros) xsum[m * G + c / group_size] += to_float(v);
    }
  }
  // batch 1, 4-bit, bf16, aligned halves: the paired kernel, reading x from a zero-padded copy
  bool paired = false;
  std::vector<uint16_t> x_paired;
#ifdef PAGODA_AVX2
  // the same on fp32 math (every activation dtype): xf grows to both halves, zero past in_features
  paired = impl != kScalar && M == 1 && bits == 4 && row_bytes % 8 == 0 && group_size % 8 == 0;
  if (paired) xf.resize(std::max<int64_t>(K, 2 * row_bytes), 0.f);
#endif
#ifdef PAGODA_BF16_DOT
  paired = use_bf16 && M == 1 && bits == 4 && row_bytes % 32 == 0 && group_size % 32 == 0;
  if (paired) {
    x_paired.assign(2 * row_bytes, 0);
    std::memcpy(x_paired.data(), xb.data(), K * sizeof(uint16_t));
  }
#endif
  // the bf16 path reads 4-bit integers as 128 + q, so their zero points move by 128 as well
  const float offset = (use_bf16 && bits == 4 && has_zeros) ? 128.f : 0.f;
  Problem p{w_q.data_ptr<uint8_t>() + row_start * row_bytes, row_bytes, xf.data(), xb.data(), K, &segs, G};

  // rows x activation rows per tile: at most 16 accumulators plus 16 running sums in registers
#ifdef PAGODA_AVX2
  const int nt_main = M == 1 ? 4 : 2;
  const int mt_main = M <= 3 ? static_cast<int>(M) : 3;
#else
  const int nt_main = M == 1 ? 8 : M <= 3 ? 4 : 2;
  const int mt_main = M <= 3 ? static_cast<int>(M) : 4;
#endif
  const bool scalar = impl == kScalar || pick_tile(use_bf16, nt_main, 1) == nullptr;
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>() + row_start;
  const int64_t num_tiles = (rows + nt_main - 1) / nt_main;

  at::parallel_for(0, num_tiles, 1, [&](int64_t tile_begin, int64_t tile_end) {
    std::vector<float> scale(nt_main * G), zero_term(nt_main * G), out(nt_main * mt_main);
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      const int64_t n0 = t * nt_main;
      const int nt = static_cast<int>(std::min<int64_t>(nt_main, rows - n0));
      // A tile's rows are a few cache lines each: too short for the hardware prefetcher to pick
      // them up, so weights streamed from L3 / DRAM would arrive one demand miss at a time.
      if (t + kPrefetchTiles < tile_end) {
        const int64_t ahead = n0 + kPrefetchTiles * nt_main;
        const int64_t ahead_rows = std::min<int64_t>(nt_main, rows - ahead);
        prefetch(p.w_q + ahead * row_bytes, ahead_rows * row_bytes);
        if (sc.fp4()) prefetch(sc.exponent + ahead * G, ahead_rows * G);
        else prefetch(sc.scale + ahead * G, ahead_rows * G * sizeof(T));
        if (has_zeros) prefetch(sc.zero + ahead * G, ahead_rows * G * sizeof(T));
      }
      for (int r = 0; r < nt; ++r) {
        sc.row(n0 + r, scale.data() + r * G, zero_term.data() + r * G);
        for (int64_t g = 0; g < G; ++g) zero_term[r * G + g] = scale[r * G + g] * (zero_term[r * G + g] + offset);
      }
      for (int64_t m0 = 0; m0 < M; m0 += mt_main) {
        const int mt = static_cast<int>(std::min<int64_t>(mt_main, M - m0));
        if (scalar) {
          dot_tile_scalar(p, n0, nt, m0, mt, scale.data(), out.data());
        } else if (paired) {
#if defined(PAGODA_BF16_DOT) || defined(PAGODA_AVX2)
          const uint8_t* tile = p.w_q + n0 * row_bytes;
          // n rows of integer or FP4 codes from row r: a whole tile at once, a partial one row by row
#ifdef PAGODA_BF16_DOT
          constexpr int kTileRows = 8;
          const auto rows = [&](auto n, auto fp4, int r) {
            dot_rows_paired<decltype(n)::value, decltype(fp4)::value>(tile + r * row_bytes, row_bytes,
                                                                      x_paired.data(), group_size, G,
                                                                      scale.data() + r * G, out.data() + r);
          };
#else
          constexpr int kTileRows = 4;
          const auto rows = [&](auto n, auto fp4, int r) {
            dot_rows_paired_x8<decltype(n)::value, decltype(fp4)::value>(tile + r * row_bytes, row_bytes, xf.data(),
                                                                         group_size, G, scale.data() + r * G,
                                                                         out.data() + r);
          };
#endif
          const auto paired_rows = [&](auto fp4) {
            if (nt == kTileRows) return rows(std::integral_constant<int, kTileRows>{}, fp4, 0);
            for (int r = 0; r < nt; ++r) rows(std::integral_constant<int, 1>{}, fp4, r);
          };
          if (codes == kFp4Codes) paired_rows(std::true_type{});
          else paired_rows(std::false_type{});
#endif
        } else if (nt == nt_main) {
          pick_tile(use_bf16, nt, mt)(p, n0, m0, scale.data(), out.data());
        } else {  // the last, partial tile of rows: one row at a time
          TileFn one = pick_tile(use_bf16, 1, mt);
          float part[4];
          for (int r = 0; r < nt; ++r) {
            one(p, n0 + r, m0, scale.data() + r * G, part);
            for (int m = 0; m < mt; ++m) out[m * nt + r] = part[m];
          }
        }
        for (int m = 0; m < mt; ++m) {
          const float* xsm = has_zeros ? xsum.data() + (m0 + m) * G : nullptr;
          for (int r = 0; r < nt; ++r) {
            float v = out[m * nt + r];
            if (has_zeros)
              for (int64_t g = 0; g < G; ++g) v -= zero_term[r * G + g] * xsm[g];
            if (bp) v += to_float(bp[row_start + n0 + r]);
            yp[(m0 + m) * ldy + n0 + r] = static_cast<T>(v);
          }
        }
      }
    }
  });
}

// y[:, row_start:row_end] = x[:, perm] @ W[row_start:row_end]^T (+ bias[row_start:row_end])
void int_linear_rows(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_scales,
                     const at::Tensor& w_zeros, const c10::optional<at::Tensor>& perm, int64_t bits,
                     int64_t group_size, int64_t row_start, int64_t row_end, at::Tensor y,
                     const c10::optional<at::Tensor>& bias, int64_t impl, int64_t gemm_min_rows, int64_t tile_rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, in] tensor");
  TORCH_CHECK(w_q.scalar_type() == at::kByte && w_q.is_contiguous(), "w_q must be contiguous uint8");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(w_scales.scalar_type() == x.scalar_type() && w_zeros.scalar_type() == x.scalar_type() &&
              y.scalar_type() == x.scalar_type(), "x, scales, zeros and y must share the model dtype");
  TORCH_CHECK(w_scales.is_contiguous() && w_zeros.is_contiguous() && y.is_contiguous(), "contiguous tensors");
  TORCH_CHECK(y.size(0) == x.size(0) && row_end <= y.size(1) && row_end <= w_q.size(0) && row_start >= 0,
              "rows out of range");
  const int64_t bytes_needed = bits == 4 ? (x.size(1) + 1) / 2 : x.size(1);
  TORCH_CHECK(w_q.size(1) >= bytes_needed && w_scales.size(1) * group_size >= x.size(1), "w_q too narrow");
  if (perm.has_value()) TORCH_CHECK(perm->scalar_type() == at::kLong && perm->numel() == x.size(1), "bad perm");
  if (bias.has_value()) TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous(), "bad bias");
  const auto run_as = [&](auto dtype) {
    using T = decltype(dtype);
    run<T>(x, w_q, group_scales<T>(w_scales, w_zeros), kIntCodes, perm, static_cast<int>(bits), group_size,
           row_start, row_end, y, bias, static_cast<int>(impl), gemm_min_rows, tile_rows);
  };
  switch (x.scalar_type()) {
    case at::kFloat: run_as(float{}); break;
    case at::kBFloat16: run_as(at::BFloat16{}); break;
    case at::kHalf: run_as(at::Half{}); break;
    default: TORCH_CHECK(false, "int_linear supports float32, bfloat16 and float16 activations");
  }
}

// An expert some token chose: its tokens, their activations [m, H], gate_up sums [m, 2I], h [m, I], outputs [m, H]
struct ActiveExpert {
  int64_t e;
  at::Tensor tokens, x, gate_up, h, y;
};

// The packed experts of one layer: codes w_q [E, rows, bytes] (integers, FP4 or FP8: `codes`), scales
// [E, rows, groups] (and zero points for integer codes), biases [E, rows] in the model dtype or none
struct PackedExperts {
  at::Tensor q, scales;
  c10::optional<at::Tensor> zeros, bias;
  int64_t group_size;
  int codes;

  template <typename T>
  GroupScales<T> of(int64_t e) const {
    const GroupScales<T> all = group_scales<T>(scales, zeros);
    return all.from_row(e * q.size(1));
  }
  c10::optional<at::Tensor> bias_of(int64_t e) const {
    return bias.has_value() ? c10::optional<at::Tensor>((*bias)[e]) : c10::nullopt;
  }
};

// The routed experts of one Mixture-of-Experts layer in the layout above, every expert's rows stacked:
// w13 [E, 2I, bytes] (gate rows, then up rows) with scales (zeros) [E, 2I, groups] and biases [E, 2I], w2 [E, H, bytes]
// with [E, H, groups] and [E, H]. The (token, slot) pairs are grouped by expert and each active expert runs on its own
// tokens only, in one parallel region of (expert, rows) items (gate_up, then down), each item's rows through run()
// (direct tiles for few tokens, a dequantized tile and a GEMM for many; run() is serial inside a parallel region):
//   h = act(x W13[e]^T gate rows + b, x W13[e]^T up rows + b),  y = h W2[e]^T + b2[e],
//   out[t] = sum_j weight[t, j] y[t, j]
// with act silu(gate) * up or gpt-oss's clamped SwiGLU (pagoda::activate). The gate_up sums, h and y are rounded to
// T as a dense MLP in T rounds them (a bias in T added before the rounding); the weighted sum is fp32, in ascending
// expert order, rounded to T once.
template <typename T>
void run_moe(const at::Tensor& x, const PackedExperts& w13, const PackedExperts& w2, const at::Tensor& topk_ids,
             const at::Tensor& topk_weights, int bits, const pagoda::ActParams& act, int impl, int64_t gemm_min_rows,
             int64_t tile_rows, at::Tensor& out) {
  const int64_t num_tokens = x.size(0), hidden = x.size(1), top_k = topk_ids.size(1);
  const int64_t num_experts = w13.q.size(0), inter = w13.q.size(1) / 2;
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const float* weights = topk_weights.data_ptr<float>();
  std::vector<std::vector<int64_t>> slots(num_experts);  // each expert's slots, in token order
  for (int64_t s = 0; s < num_tokens * top_k; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < num_experts, "expert id ", ids[s], " out of range [0, ", num_experts, ")");
    slots[ids[s]].push_back(s);
  }
  std::vector<ActiveExpert> active;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // Work items of whole tiles of 8 rows, about four per thread: each run() call prepares its activations once
  // (a few microseconds), so items are as large as the balance of the threads allows (32 to 512 KiB of packed
  // rows); an expert on the GEMM path is one item per thread
  int64_t num_active = 0;
  for (const auto& s : slots) num_active += !s.empty();
  const auto chunk = [&](int64_t rows, int64_t row_bytes, int64_t m) {
    const int64_t bytes = std::clamp<int64_t>(num_active * rows * row_bytes / (4 * threads), 32768, 524288);
    const int64_t small = std::max<int64_t>(8, bytes / std::max<int64_t>(1, row_bytes) / 8 * 8);
    return m >= gemm_min_rows ? std::max<int64_t>(small, (rows + threads - 1) / threads) : small;
  };
  std::vector<std::tuple<int64_t, int64_t, int64_t>> gate_items, down_items;  // (active index, first row, end)
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t m = static_cast<int64_t>(slots[e].size());
    if (m == 0) continue;
    ActiveExpert a{e, at::empty({m}, at::TensorOptions().dtype(at::kLong)), {}, {}, {}, {}};
    int64_t* tp = a.tokens.data_ptr<int64_t>();
    for (int64_t r = 0; r < m; ++r) tp[r] = slots[e][r] / top_k;
    a.x = x.index_select(0, a.tokens);
    a.gate_up = at::empty({m, 2 * inter}, x.options());
    a.h = at::empty({m, inter}, x.options());
    a.y = at::empty({m, hidden}, x.options());
    const int64_t idx = static_cast<int64_t>(active.size());
    const int64_t c1 = chunk(inter, w13.q.size(2) * 2, m), c2 = chunk(hidden, w2.q.size(2), m);
    for (int64_t n = 0; n < inter; n += c1) gate_items.emplace_back(idx, n, std::min(inter, n + c1));
    for (int64_t n = 0; n < hidden; n += c2) down_items.emplace_back(idx, n, std::min(hidden, n + c2));
    active.push_back(std::move(a));
  }
  // the gate_up items, then the down items, in one parallel region; the worker threads take the caller's
  // inference / grad mode for the tensor ops of run()'s GEMM path
  const at::ThreadLocalState caller_state;
  const auto gate_up_item = [&](int64_t i) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    const auto [idx, n0, n1] = gate_items[i];
    ActiveExpert& a = active[idx];
    for (const int64_t first : {n0, inter + n0})  // the gate rows, then the same up rows
      run<T>(a.x, w13.q[a.e], w13.of<T>(a.e), w13.codes, c10::nullopt, bits, w13.group_size, first, first + n1 - n0, a.gate_up,
             w13.bias_of(a.e), impl, gemm_min_rows, tile_rows);
    const T* gu = a.gate_up.data_ptr<T>();
    T* hp = a.h.data_ptr<T>();
    for (int64_t r = 0; r < a.x.size(0); ++r)
      for (int64_t n = n0; n < n1; ++n)
        hp[r * inter + n] = static_cast<T>(pagoda::activate(to_float(gu[r * 2 * inter + n]),
                                                            to_float(gu[r * 2 * inter + inter + n]), act));
  };
  const auto down_item = [&](int64_t i) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    const auto [idx, n0, n1] = down_items[i];
    ActiveExpert& a = active[idx];
    run<T>(a.h, w2.q[a.e], w2.of<T>(a.e), w2.codes, c10::nullopt, bits, w2.group_size, n0, n1, a.y, w2.bias_of(a.e), impl,
           gemm_min_rows, tile_rows);
  };
  pagoda::parallel_two_phases(static_cast<int64_t>(gate_items.size()), gate_up_item,
                              static_cast<int64_t>(down_items.size()), down_item);
  std::vector<float> acc(num_tokens * hidden, 0.f);  // [T, H] the weighted sums, experts in ascending order
  for (const ActiveExpert& a : active) {
    const T* yp = a.y.data_ptr<T>();
    const int64_t* tp = a.tokens.data_ptr<int64_t>();
    for (int64_t r = 0; r < a.x.size(0); ++r) {
      const float w = weights[slots[a.e][r]];
      float* dst = acc.data() + tp[r] * hidden;
      for (int64_t i = 0; i < hidden; ++i) dst[i] += w * to_float(yp[r * hidden + i]);
    }
  }
  T* o = out.data_ptr<T>();
  for (int64_t i = 0; i < num_tokens * hidden; ++i) o[i] = static_cast<T>(acc[i]);
}

// One projection of the packed experts, checked against its shapes and codes: integers (scales and zeros in x's
// dtype), FP4 (4-bit, uint8 E8M0 scales, no zero points) or FP8 (8-bit, scales in x's dtype, no zero points);
// biases float32 [E, rows] (the checkpoint's), taken in x's dtype
PackedExperts packed_experts(const at::Tensor& w_q, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                             const c10::optional<at::Tensor>& bias, int64_t rows, int64_t in_features, int64_t bits,
                             int64_t group_size, int64_t codes, const at::Tensor& x, const char* name) {
  TORCH_CHECK(w_q.scalar_type() == at::kByte && w_q.dim() == 3 && w_q.is_contiguous() && w_q.size(1) == rows,
              name, "_q must be a contiguous uint8 [E, ", rows, ", bytes] tensor");
  TORCH_CHECK(group_size >= 1, "group sizes must be positive");
  const int64_t groups = (in_features + group_size - 1) / group_size;
  const int64_t bytes = bits == 4 ? (groups * group_size + 1) / 2 : groups * group_size;
  TORCH_CHECK(w_q.size(2) == bytes, name, "_q holds ", w_q.size(2), " bytes per row; ", in_features,
              " columns in groups of ", group_size, " take ", bytes);
  TORCH_CHECK(codes == kIntCodes || codes == kFp4Codes || codes == kFp8Codes, "codes must be 0, 1 or 2");
  TORCH_CHECK(zeros.has_value() == (codes == kIntCodes), name, ": integer codes take zero points, FP4 and FP8 none");
  TORCH_CHECK(codes != kFp4Codes || (bits == 4 && scales.scalar_type() == at::kByte), name,
              ": FP4 codes are 4-bit, with uint8 E8M0 scales");
  TORCH_CHECK(codes != kFp8Codes || bits == 8, name, ": FP8 codes are 8-bit");
  TORCH_CHECK(codes == kFp4Codes || scales.scalar_type() == x.scalar_type(), name, " scales must be of x's dtype");
  for (const at::Tensor* t : {&scales, zeros.has_value() ? &*zeros : &scales})
    TORCH_CHECK(t->scalar_type() == scales.scalar_type() && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == w_q.size(0) && t->size(1) == rows && t->size(2) == groups,
                name, " scales and zeros must be contiguous [E, ", rows, ", ", groups, "] tensors");
  c10::optional<at::Tensor> bias_t;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 2 && bias->size(0) == w_q.size(0) &&
                    bias->size(1) == rows,
                name, " biases must be a float32 [E, ", rows, "] tensor");
    bias_t = bias->to(x.scalar_type()).contiguous();
  }
  return {w_q, scales, zeros, bias_t, group_size, static_cast<int>(codes)};
}

// x [T, H] (float32, bfloat16 or float16); w13_q [E, 2I, bytes], s13 (z13) [E, 2I, groups of H], b13 [E, 2I];
// w2_q [E, H, bytes], s2 (z2) [E, H, groups of I], b2 [E, H]; topk_ids [T, k] int64, topk_weights [T, k] float32;
// codes: 0 integers, 1 FP4, 2 FP8; activation: 0 silu(gate) * up, 1 gpt-oss's clamped SwiGLU (alpha, limit)
at::Tensor int_moe_experts(const at::Tensor& x, const at::Tensor& w13_q, const at::Tensor& s13,
                           const c10::optional<at::Tensor>& z13, const at::Tensor& w2_q, const at::Tensor& s2,
                           const c10::optional<at::Tensor>& z2, const c10::optional<at::Tensor>& b13,
                           const c10::optional<at::Tensor>& b2, const at::Tensor& topk_ids,
                           const at::Tensor& topk_weights, int64_t bits, int64_t codes, int64_t group13,
                           int64_t group2, int64_t activation, double alpha, double limit, int64_t impl, int64_t gemm_min_rows,
                           int64_t tile_rows) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU [T, H] tensor");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(activation == pagoda::kSiluMul || activation == pagoda::kClampedSwiglu, "activation must be 0 or 1");
  const int64_t hidden = x.size(1), inter = w13_q.dim() == 3 ? w13_q.size(1) / 2 : 0;
  const PackedExperts w13 = packed_experts(w13_q, s13, z13, b13, 2 * inter, hidden, bits, group13, codes, x, "w13");
  const PackedExperts w2 = packed_experts(w2_q, s2, z2, b2, hidden, inter, bits, group2, codes, x, "w2");
  TORCH_CHECK(w2_q.size(0) == w13_q.size(0), "w13 and w2 must hold the same experts");
  pagoda::check_routing(x, topk_ids, topk_weights);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const pagoda::ActParams act{activation, static_cast<float>(alpha), static_cast<float>(limit)};
  const auto run_as = [&](auto dtype) {
    run_moe<decltype(dtype)>(x, w13, w2, topk_ids, topk_weights, static_cast<int>(bits), act, static_cast<int>(impl),
                             gemm_min_rows, tile_rows, out);
  };
  switch (x.scalar_type()) {
    case at::kFloat: run_as(float{}); break;
    case at::kBFloat16: run_as(at::BFloat16{}); break;
    case at::kHalf: run_as(at::Half{}); break;
    default: TORCH_CHECK(false, "int_moe_experts supports float32, bfloat16 and float16 activations");
  }
  return out;
}

// the ISA path of the direct (small-batch) kernel: avx512_bf16, avx512, avx2 or scalar
std::string isa_path() {
#if defined(PAGODA_BF16_DOT)
  return "avx512_bf16";
#elif defined(PAGODA_AVX512)
  return "avx512";
#elif defined(PAGODA_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

bool has_bf16_dot() {
#ifdef PAGODA_BF16_DOT
  return true;
#else
  return false;
#endif
}

}  // namespace

// every kernel runs without the GIL: a server's event loop and tokenizer thread go on while a step
// computes (the arguments are converted before the call and the result after it, both with the GIL)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const pybind11::call_guard<pybind11::gil_scoped_release> no_gil{};
  m.def("int_linear_rows", &int_linear_rows, "group-wise int4/int8 linear from the packed layout (CPU)",
        no_gil, pybind11::arg("x"), pybind11::arg("w_q"), pybind11::arg("w_scales"), pybind11::arg("w_zeros"),
        pybind11::arg("perm"), pybind11::arg("bits"), pybind11::arg("group_size"), pybind11::arg("row_start"),
        pybind11::arg("row_end"), pybind11::arg("y"), pybind11::arg("bias"), pybind11::arg("impl"),
        pybind11::arg("gemm_min_rows"), pybind11::arg("tile_rows"));
  m.def("int_moe_experts", &int_moe_experts,
        "the routed experts of one MoE layer from packed int or MXFP4 weights (CPU)", no_gil, pybind11::arg("x"),
        pybind11::arg("w13_q"), pybind11::arg("s13"), pybind11::arg("z13"), pybind11::arg("w2_q"), pybind11::arg("s2"),
        pybind11::arg("z2"), pybind11::arg("b13"), pybind11::arg("b2"), pybind11::arg("topk_ids"),
        pybind11::arg("topk_weights"), pybind11::arg("bits"), pybind11::arg("codes"), pybind11::arg("group13"),
        pybind11::arg("group2"), pybind11::arg("activation"), pybind11::arg("alpha"), pybind11::arg("limit"), pybind11::arg("impl"),
        pybind11::arg("gemm_min_rows"), pybind11::arg("tile_rows"));
  m.def("has_bf16_dot", &has_bf16_dot, "whether the AVX512-BF16 path was compiled in");
  m.def("isa_path", &isa_path, "the ISA path of the direct kernel: avx512_bf16, avx512, avx2 or scalar");
}
