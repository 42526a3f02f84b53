// The bf16 dot-product tile of pagoda's C++ kernels on CPUs with AVX512_BF16 (defined only where the build has
// it): MB bf16 activation rows against R bf16 weight rows, fp32 sums.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace pagoda {

// how far ahead of its loads a tile asks for weights: decode steps stream every weight from memory once, and the
// hardware prefetchers alone left one thread at about half the bandwidth oneDNN's packed GEMM draws (AMD Zen 5)
constexpr int64_t kWeightPrefetchBytes = 8192;

// sums[m * R + r] = x[m] . rows[r] for x rows [0, MB) (stride x_stride) and R weight rows of k values, 32 a step
// through bf16 dot products (each lane sums a pair of exact products in fp32). Every load is masked (all lanes but
// in the last step of a k that is not a multiple of 32, whose missing lanes read as zeros), so a row's sum is the
// same whatever MB and R are. The loops over m and r are unrolled by pragma: unrolled later by the compiler on its
// own, the accumulators stayed in registers but were also stored to the stack every step (GCC 12: 24 stores per
// 24 dot products at 4 x 6).
template <int R, int MB>
inline void bf16_dot_tile(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* const* rows, int64_t k,
                          float* sums) {
  __m512 acc[MB][R];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    const __mmask32 mask = k - i >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (k - i)) - 1);
    __m512bh wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[r] + i);
      _mm_prefetch(reinterpret_cast<const char*>(rows[r] + i) + kWeightPrefetchBytes, _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * x_stride + i);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sums[m * R + r] = _mm512_reduce_add_ps(acc[m][r]);
}

}  // namespace pagoda
#endif
