// How a code of pagoda's packed int / MXFP4 / FP8 layout becomes its value (the layout and the arithmetic are
// described at the top of cpu_int_kernels.cpp): the kinds of codes and where they sit in a row (segments), a
// row's group scales (GroupScales), one code's value, and per ISA path, 8, 16 or 32 codes widened to fp32 lanes
// (AVX2, AVX-512) or to bf16 words (AVX512-BF16). Also the choice of ISA path (PAGODA_AVX512, PAGODA_AVX2,
// PAGODA_BF16_DOT) by the flags the kernel is built with.
//
// Part of the one translation unit cpu_int_kernels.cpp (its definitions are internal to that build, in an unnamed
// namespace); the build's name covers this file's text, so an edit here builds the kernel anew.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "pagoda_vec8.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PAGODA_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// no AVX-512: the direct path's fp32 FMAs and the dequantization on 8-lane registers (every activation
// dtype computes in fp32 here; bf16 activations are widened once per call)
#include <immintrin.h>
#define PAGODA_AVX2 1
#endif
#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)
#define PAGODA_BF16_DOT 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
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
// zero points), in T or float32 (FP8 codes, no zero points), or E8M0 exponents (FP4 codes, no zero points)
template <typename T>
struct GroupScales {
  const T* scale;
  const T* zero;            // null: no zero points
  const uint8_t* exponent;  // set for FP4 codes, in place of scale
  const float* scale_f32;   // set for float32 scales of a model in another dtype, in place of scale
  int64_t G;

  bool fp4() const { return exponent != nullptr; }
  bool has_zeros() const { return zero != nullptr; }
  GroupScales from_row(int64_t r) const {
    const auto offset = [&](auto* p) { return p ? p + r * G : p; };
    return GroupScales{offset(scale), offset(zero), offset(exponent), offset(scale_f32), G};
  }
  // row o's scales and zero points as fp32
  void row(int64_t o, float* s, float* z) const {
    for (int64_t g = 0; g < G; ++g) {
      s[g] = fp4() ? e8m0_value(exponent[o * G + g]) : scale_f32 ? scale_f32[o * G + g] : to_float(scale[o * G + g]);
      z[g] = has_zeros() ? to_float(zero[o * G + g]) : 0.f;
    }
  }
  // the first byte of row o's scales and the bytes of a row's, for prefetching
  const void* row_address(int64_t o) const {
    if (fp4()) return exponent + o * G;
    return scale_f32 ? static_cast<const void*>(scale_f32 + o * G) : static_cast<const void*>(scale + o * G);
  }
  int64_t row_bytes() const { return G * (fp4() ? 1 : scale_f32 ? sizeof(float) : sizeof(T)); }
};

// w_scales / w_zeros as GroupScales: uint8 scales are E8M0 exponents of FP4 codes, float32 ones of a model in another
// dtype are read as float32
template <typename T>
GroupScales<T> group_scales(const at::Tensor& scales, const c10::optional<at::Tensor>& zeros) {
  if (scales.scalar_type() == at::kByte)
    return {nullptr, nullptr, scales.data_ptr<uint8_t>(), nullptr, scales.size(-1)};
  const T* zero = zeros.has_value() ? zeros->data_ptr<T>() : nullptr;
  if (scales.scalar_type() == at::kFloat && !std::is_same<T, float>::value)
    return {nullptr, zero, nullptr, scales.data_ptr<float>(), scales.size(-1)};
  return {scales.data_ptr<T>(), zero, nullptr, nullptr, scales.size(-1)};
}

#ifdef PAGODA_AVX512
inline __mmask16 mask16(int64_t n) { return n <= 0 ? 0 : n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }
inline __mmask32 mask32(int64_t n) { return n <= 0 ? 0 : n >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << n) - 1); }

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

// the values of the 16 4-bit codes: the integers 0..15, or FP4's
inline __m512 nibble_values(bool fp4) {
  return fp4 ? _mm512_load_ps(kFp4Values) : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
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
#endif

#ifdef PAGODA_BF16_DOT
// 32 4-bit codes (16-bit lanes) as bf16 words: integers as 128 + q (exact), FP4 codes as their values
template <bool FP4>
inline __m512i nibbles_bf16(__m512i q) {
  return FP4 ? _mm512_permutexvar_epi16(q, _mm512_load_si512(kFp4Bf16)) : _mm512_or_si512(q, _mm512_set1_epi16(0x4300));
}

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

// 32 codes of a segment as bf16 words: 4-bit integers as 128 + q (exact), FP4 codes as their values, 8-bit
// integers converted
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
#endif

}  // namespace
