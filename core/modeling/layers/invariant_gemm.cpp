// The batch-invariant mode's bf16 GEMM: y = x W^T (+ bias) in which every output's bits depend on its own input
// row alone, whatever the number of rows, their order, the tiles or the thread count.
//
// W is packed once, at load time, so that one vector load holds 16 outputs x 2 consecutive k's (bf16 pairs):
// outputs in blocks of 16, block b holding outputs [16 b, 16 b + w) (w = 16, or N % 16 for the last block) as
// [ceil(K / 2)][w][2] bf16, the blocks one after the other; a K that is odd ends with a zero pair half. The
// packed tensor is shaped [N, ceil(K / 2), 2] (its sizes; the memory is in the block order above), the same
// number of elements as W, or N more for an odd K.
//
// Each output accumulates its K in one fp32 register lane, in order: with AVX-512 BF16 one vdpbf16ps per pair of
// k's (the activation pair broadcast to the 16 lanes), on AVX2 (and AVX-512 without BF16) two FMAs per pair, k
// then k + 1, of the widened weights and the fp32 activation. The microkernels differ only in how many rows and
// blocks they carry in registers, never in an output's sequence of operations, so 1 row (decode) and 512 rows
// (a prompt) give the same bits by construction, with no sum across lanes. Then + bias in fp32 and one rounding
// to bf16 (nearest even, a NaN -> 0x7FC0). The threads take work items of whole outputs (a tile of blocks by a
// block of rows), never part of a sum.

#include "pagoda_float.h"
#include "pagoda_parallel.h"
#include "pagoda_torch.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if (defined(__AVX512BF16__) && defined(__AVX512F__)) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 16;  // outputs per packed block: one zmm of fp32 lanes, two ymm
constexpr int kTileBlocks = 4;  // blocks per work item: 64 outputs
constexpr int64_t kRowBlock = 96;  // activation rows per work item: their outputs' weights stay in L2 meanwhile

// weights asked for this far ahead in each block's stream, by the first row tile of a work item (the one that
// reads them from memory): a decode step's weights come from memory once. One thread, the default model's four
// linears x 30 layers at 1 row (AMD Zen 5): 2 KiB 0.23 ms a layer, 1 and 3 KiB the same, 4 KiB 0.24, 8 KiB 0.26,
// none 0.25 (at 8 rows 0.29, 0.29-0.31, 0.30-0.31, 0.32, 0.34-0.37)
constexpr int64_t kPrefetchBytes = 2048;

inline const uint16_t* bits_of(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PAGODA_INVARIANT_GEMM 1
constexpr const char* kPath = "avx512_bf16";
constexpr int kTileRows = 6;  // 6 rows x 4 blocks: 24 zmm accumulators, 4 weight vectors, the broadcast pair
using RowElem = uint16_t;  // the activations as the microkernels read them: bf16 bits

// x [M, K] as the microkernels read it: as it is for an even K; for an odd K, with a zero column after the last,
// so every k pair is whole (the weights' pad is zero too)
at::Tensor kernel_rows(const at::Tensor& x, int64_t pairs) {
  if (x.size(1) % 2 == 0) return x;
  auto padded = at::zeros({x.size(0), 2 * pairs}, x.options());
  padded.narrow(1, 0, x.size(1)).copy_(x);
  return padded;
}

// fp32 -> bf16 bits, nearest even, NaN -> 0x7FC0 (pagoda::from_f, 16 lanes)
inline __m256i bf16_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// MB rows of x (bf16, K even: pairs read as one 32-bit word) against NB blocks of the packed weights (the first at
// w, the next block_stride elements on; pair_stride elements per k pair: 32, or 2 w for the last block, whose
// lanes past w the mask leaves out), then + bias, rounded, stored to y.
template <int MB, int NB, bool MASKED>
inline void tile(const uint16_t* x, int64_t xs, int64_t pairs, const uint16_t* w, int64_t block_stride,
                 int64_t pair_stride, __mmask16 mask, bool prefetch, const float* bias, uint16_t* y, int64_t ys) {
  __m512 acc[MB][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const uint16_t* wp = w + j * block_stride + p * pair_stride;
      wv[j] = (__m512bh)(MASKED ? _mm512_maskz_loadu_epi32(mask, wp) : _mm512_loadu_si512(wp));
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * xs + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NB; ++j) {
    const float* bj = bias ? bias + j * kBlock : nullptr;
    const __m512 b = bj ? (MASKED ? _mm512_maskz_loadu_ps(mask, bj) : _mm512_loadu_ps(bj)) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256i out = bf16_bits16(_mm512_add_ps(acc[m][j], b));
      if (MASKED) _mm256_mask_storeu_epi16(y + m * ys + j * kBlock, mask, out);
      else _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ys + j * kBlock), out);
    }
  }
}

// MB rows against blocks [b0, b1): four at a time where they are whole, then one by one
template <int MB>
void tile_rows(const uint16_t* x, int64_t xs, int64_t pairs, const uint16_t* packed, int64_t n, int64_t b0, int64_t b1,
               bool prefetch, const float* bias, uint16_t* y, int64_t ys) {
  const int64_t block_stride = kBlock * 2 * pairs;
  const int64_t whole = n / kBlock;
  int64_t b = b0;
  for (; b + kTileBlocks <= std::min(b1, whole); b += kTileBlocks)
    tile<MB, kTileBlocks, false>(x, xs, pairs, packed + b * block_stride, block_stride, 2 * kBlock, 0xFFFF, prefetch,
                                 bias ? bias + b * kBlock : nullptr, y + b * kBlock, ys);
  for (; b < b1; ++b) {
    const int64_t width = std::min(kBlock, n - b * kBlock);
    const uint16_t* wb = packed + b * block_stride;
    const float* bb = bias ? bias + b * kBlock : nullptr;
    if (width == kBlock)
      tile<MB, 1, false>(x, xs, pairs, wb, block_stride, 2 * kBlock, 0xFFFF, prefetch, bb, y + b * kBlock, ys);
    else
      tile<MB, 1, true>(x, xs, pairs, wb, block_stride, 2 * width, static_cast<__mmask16>((1u << width) - 1),
                        prefetch, bb, y + b * kBlock, ys);
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
#define PAGODA_INVARIANT_GEMM 1
constexpr const char* kPath = "avx2";
constexpr int kTileRows = 4;  // 4 rows x one block: 8 ymm accumulators, 4 widened weight vectors, the broadcast
using RowElem = float;  // the activations as the microkernels read them: fp32

// x [M, K] as the microkernels read it: fp32, once (every block reads it again), with a zero column after the
// last for an odd K
at::Tensor kernel_rows(const at::Tensor& x, int64_t pairs) {
  auto widened = at::zeros({x.size(0), 2 * pairs}, x.options().dtype(at::kFloat));
  widened.narrow(1, 0, x.size(1)).copy_(x);
  return widened;
}

// fp32 -> bf16 bits in the low half of each lane, nearest even, NaN -> 0x7FC0 (pagoda::from_f, 8 lanes)
inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

inline __m256i load_ints8(const int* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// lanes [0, width) of a vector of 8
inline __m256i lanes_below(int64_t width) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(width)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// MB rows of x (fp32, K even) against one block of the packed weights (pair_stride elements per k pair: 32, or
// 2 w for the last block, whose lanes past w the masks leave out): per pair, each weight vector widened to its
// k (the low half of each 32-bit pair) and k + 1 (the high half), then + bias, rounded, stored to y.
template <int MB, bool MASKED>
inline void tile(const float* x, int64_t xs, int64_t pairs, const uint16_t* w, int64_t pair_stride, int64_t width,
                 bool prefetch, const float* bias, uint16_t* y, int64_t ys) {
  const __m256i mask_lo = MASKED ? lanes_below(width) : _mm256_set1_epi32(-1);
  const __m256i mask_hi = MASKED ? lanes_below(width - 8) : _mm256_set1_epi32(-1);
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[MB][2];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + p * pair_stride;
    const int* wi = reinterpret_cast<const int*>(wp);
    const __m256i v0 = MASKED ? _mm256_maskload_epi32(wi, mask_lo) : load_ints8(wi);
    const __m256i v1 = MASKED ? _mm256_maskload_epi32(wi + 8, mask_hi) : load_ints8(wi + 8);
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
    const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
    const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * xs + 2 * p);
      acc[m][0] = _mm256_fmadd_ps(even0, xv, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(even1, xv, acc[m][1]);
    }
    const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high_half));
    const __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high_half));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * xs + 2 * p + 1);
      acc[m][0] = _mm256_fmadd_ps(odd0, xv, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(odd1, xv, acc[m][1]);
    }
  }
  const __m256 b0 = bias ? (MASKED ? _mm256_maskload_ps(bias, mask_lo) : _mm256_loadu_ps(bias)) : _mm256_setzero_ps();
  const __m256 b1 = bias ? (MASKED ? _mm256_maskload_ps(bias + 8, mask_hi) : _mm256_loadu_ps(bias + 8))
                         : _mm256_setzero_ps();
  for (int m = 0; m < MB; ++m) {
    // two vectors of 16-bit values in 32-bit lanes -> 16 bf16 in order
    const __m256i out = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(bf16_bits8(_mm256_add_ps(acc[m][0], b0)), bf16_bits8(_mm256_add_ps(acc[m][1], b1))), 0xD8);
    if (MASKED) {
      alignas(32) uint16_t lanes[kBlock];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), out);
      std::memcpy(y + m * ys, lanes, width * sizeof(uint16_t));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ys), out);
    }
  }
}

// MB rows against blocks [b0, b1), one at a time
template <int MB>
void tile_rows(const float* x, int64_t xs, int64_t pairs, const uint16_t* packed, int64_t n, int64_t b0, int64_t b1,
               bool prefetch, const float* bias, uint16_t* y, int64_t ys) {
  const int64_t block_stride = kBlock * 2 * pairs;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t width = std::min(kBlock, n - b * kBlock);
    const uint16_t* wb = packed + b * block_stride;
    const float* bb = bias ? bias + b * kBlock : nullptr;
    if (width == kBlock) tile<MB, false>(x, xs, pairs, wb, 2 * kBlock, width, prefetch, bb, y + b * kBlock, ys);
    else tile<MB, true>(x, xs, pairs, wb, 2 * width, width, prefetch, bb, y + b * kBlock, ys);
  }
}
#else
constexpr const char* kPath = "";
#endif

#ifdef PAGODA_INVARIANT_GEMM
// tile_rows for `rows` rows (1 to kTileRows)
template <int MB = kTileRows>
void tile_rows_of(int64_t rows, const RowElem* x, int64_t xs, int64_t pairs, const uint16_t* packed, int64_t n,
                  int64_t b0, int64_t b1, bool prefetch, const float* bias, uint16_t* y, int64_t ys) {
  if constexpr (MB > 1) {
    if (rows < MB) return tile_rows_of<MB - 1>(rows, x, xs, pairs, packed, n, b0, b1, prefetch, bias, y, ys);
  }
  tile_rows<MB>(x, xs, pairs, packed, n, b0, b1, prefetch, bias, y, ys);
}
#endif

}  // namespace

// the ISA path of the kernels: avx512_bf16, avx2 (fp32 FMAs, also on AVX-512 without BF16), or empty (none)
std::string path() { return kPath; }

// weight: [N, K] bf16 contiguous. Returns it packed (see the top of this file): [N, ceil(K / 2), 2] bf16.
at::Tensor pack_bf16(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
                  weight.is_contiguous(),
              "weight must be a contiguous bf16 [N, K] CPU tensor, got ", weight.scalar_type(), " ",
              weight.sizes(), weight.is_contiguous() ? "" : " (not contiguous: pass weight.contiguous())");
  const int64_t n = weight.size(0), k = weight.size(1), pairs = (k + 1) / 2;
  auto packed = at::empty({n, pairs, 2}, weight.options());
  const uint16_t* src = bits_of(weight);
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  pagoda::parallel_items((n + kBlock - 1) / kBlock, [&](int64_t b) {
    const int64_t width = std::min(kBlock, n - b * kBlock);
    uint16_t* out = dst + b * kBlock * 2 * pairs;
    for (int64_t p = 0; p < pairs; ++p)
      for (int64_t j = 0; j < width; ++j) {
        const uint16_t* row = src + (b * kBlock + j) * k;
        out[(p * width + j) * 2] = row[2 * p];
        out[(p * width + j) * 2 + 1] = 2 * p + 1 < k ? row[2 * p + 1] : uint16_t{0};
      }
  });
  return packed;
}

// x: [M, K] bf16 with contiguous rows; packed: pack_bf16 of a [N, K] weight; bias: [N] or none. Returns [M, N] bf16.
at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kPath[0] != '\0', "this build has neither AVX-512 BF16 nor AVX2 + FMA: no batch-invariant bf16 GEMM");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "x and the packed weight must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "x and weight must be bf16, got ", x.scalar_type(), " and ", packed.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 && packed.is_contiguous(),
              "the weight must be packed by pack_bf16 ([N, ceil(K / 2), 2]), got a tensor of shape ", packed.sizes());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.size(1) + 1) / 2 == packed.size(1),
              "x must be [M, K] with contiguous rows, K matching the packed weight's ", packed.size(1),
              " pairs, got shape ", x.sizes());
  const int64_t m = x.size(0), n = packed.size(0), pairs = packed.size(1);
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kBFloat16, "bias must be [N] bf16 (N = ", n,
                "), got ", bias->scalar_type(), " ", bias->sizes());
    bias_f = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({m, n}, x.options());
#ifdef PAGODA_INVARIANT_GEMM
  if (m == 0 || n == 0) return y;
  const auto rows = kernel_rows(x, pairs);
  const RowElem* xp = static_cast<const RowElem*>(rows.data_ptr());
  const int64_t xs = rows.stride(0);
  const uint16_t* wp = bits_of(packed);
  const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  const int64_t num_tiles = (num_blocks + kTileBlocks - 1) / kTileBlocks;
  const int64_t num_row_blocks = (m + kRowBlock - 1) / kRowBlock;
  // items row block by row block: the threads share a block of rows (in the shared cache) while each takes tiles
  pagoda::parallel_items(num_row_blocks * num_tiles, [&](int64_t item) {
    const int64_t r0 = item / num_tiles * kRowBlock, r1 = std::min(m, r0 + kRowBlock);
    const int64_t b0 = item % num_tiles * kTileBlocks, b1 = std::min(num_blocks, b0 + kTileBlocks);
    for (int64_t m0 = r0; m0 < r1; m0 += kTileRows)
      tile_rows_of(std::min<int64_t>(kTileRows, r1 - m0), xp + m0 * xs, xs, pairs, wp, n, b0, b1, m0 == r0, bp,
                   yp + m0 * n, n);
  });
#endif
  return y;
}

// every kernel runs without the GIL (see cpu_ops.cpp)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const pybind11::call_guard<pybind11::gil_scoped_release> no_gil{};
  m.def("path", &path, "the ISA path of the kernels: avx512_bf16, avx2, or empty (none)");
  m.def("pack_bf16", &pack_bf16, "a bf16 [N, K] weight in the layout gemm_bf16 reads", no_gil);
  m.def("gemm_bf16", &gemm_bf16,
        "y = x W^T (+ bias) over a packed bf16 weight, each output's bits independent of the other rows", no_gil,
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias") = pybind11::none());
}
