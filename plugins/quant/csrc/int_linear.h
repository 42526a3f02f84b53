// One quantized linear's rows (pagoda's int / MXFP4 / FP8 layout): run() takes the GEMM path from gemm_min_rows
// activation rows on and the direct path below, preparing the activations once per call (in the packed column
// order, with per-group sums for the zero points) and spreading tiles of rows over the threads; int_linear_rows
// checks a call's tensors and runs it in the activations' dtype.
//
// Part of the one translation unit cpu_int_kernels.cpp (its definitions are internal to that build, in an unnamed
// namespace); the build's name covers this file's text, so an edit here builds the kernel anew.
#pragma once

#include <ATen/Parallel.h>

#include "int_codes.h"
#include "int_direct.h"
#include "int_gemm.h"

namespace {

enum Impl { kAuto = 0, kScalar = 1 };

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
        prefetch(sc.row_address(ahead), ahead_rows * sc.row_bytes());
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

}  // namespace
