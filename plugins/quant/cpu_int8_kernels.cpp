// W8A8 linear layers for x86 CPUs: int8 weights (one scale per output channel) times int8 activations
// (one scale per token, computed here), with exact int32 sums.
//
// Weight layout (packed once at load, see int8_linear.py): int8 [N / 16, K / 4, 16, 4] with N and K
// padded with zero weights to multiples of 16 and 4. One 64-byte line holds 4 consecutive input
// columns of 16 output rows, which is what a dot-product instruction multiplies against 4 activation
// bytes broadcast to every 32-bit lane: 16 (AVX-512) or 8 (256-bit) partial sums, no horizontal adds.
//
// Activations (the pre-pass): per row m, s[m] = max|x[m]| / 127, q = round_half_even(x / s) clamped
// to [-127, 127] (symmetric: no zero point). Then
//   y[m, n] = (float(sum_k q[m, k] * w[n, k]) * s[m]) * w_scale[n] (+ bias[n]).
// Paths, picked when the file is compiled (cpu_isa.py decides the flags):
// - avx512_vnni: vpdpbusd multiplies unsigned by signed bytes, so activations are stored as q + 128
//   (1..255) and 128 * colsum[n] (sum of row n's weights, made at load) is subtracted from the sum.
// - avx_vnni: the same on 256-bit registers (VEX vpdpbusd; AVX-512 VNNI's 256-bit form when a test
//   build asks for it with PAGODA_INT8_VNNI256 on a machine without AVX-VNNI).
// - avx2: vpmaddubsw(|w|, sign(q, w)) then vpmaddwd with ones. vpmaddubsw adds two u8 x s8 products
//   into a saturating int16; with |w| <= 128 and |q| <= 127 a pair is at most 2 * 128 * 127 = 32512,
//   inside int16, so nothing saturates (the +128 shift would reach 2 * 255 * 127 and saturate).
// - scalar: the same sums in plain loops.
// Every path gives the same int32 sums, so they differ only in float rounding of the epilogue.

#include "pagoda_torch.h"
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(PAGODA_INT8_VNNI256)
#include <immintrin.h>
#define INT8_AVX512_VNNI 1
#elif defined(__AVX2__) && (defined(__AVXVNNI__) || (defined(PAGODA_INT8_VNNI256) && defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#include <immintrin.h>
#define INT8_AVX_VNNI 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define INT8_AVX2 1
#endif

#if defined(INT8_AVX512_VNNI) || defined(INT8_AVX_VNNI)
#define INT8_UNSIGNED_ACTIVATIONS 1  // q + 128, corrected with the weights' column sums
#endif

namespace {

constexpr int kBlockRows = 16;  // output rows per packed block
constexpr int kDepth = 4;       // input columns per 32-bit lane
constexpr int kScalar = 1;      // impl: force the scalar path
// A tile's weights are read once per chunk of kChunkGroups * 4 columns by every activation row of a
// chunk of kChunkRows: 64 rows x 256 columns (16 KiB) stay in L1, the int32 sums (64 KiB) in L2.
constexpr int64_t kChunkGroups = 64;
constexpr int64_t kChunkRows = 256;

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(at::Half v) { return static_cast<float>(v); }

// ---- the pre-pass: one row of activations -> int8 codes (or codes + 128) and its scale ----
template <typename T>
float quantize_row(const T* x, int64_t K, int64_t k_pad, float* buf, uint8_t* out, bool shift) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    buf[k] = to_float(x[k]);
    amax = std::max(amax, std::fabs(buf[k]));
  }
  const float scale = amax / 127.f;
  const uint8_t offset = shift ? 128 : 0;
  int64_t k = 0;
  if (scale > 0.f) {
#if defined(INT8_AVX512_VNNI)
    const __m512 vs = _mm512_set1_ps(scale);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(offset);
    for (; k + 16 <= K; k += 16) {  // cvtps rounds half to even under the default MXCSR, like torch.round
      __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(buf + k), vs));
      q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), off);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(q));
    }
#elif defined(INT8_AVX2) || defined(INT8_AVX_VNNI)
    const __m256 vs = _mm256_set1_ps(scale);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127), off = _mm256_set1_epi32(offset);
    for (; k + 8 <= K; k += 8) {
      __m256i q = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(buf + k), vs));
      q = _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(q, lo), hi), off);
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), q);
      for (int i = 0; i < 8; ++i) out[k + i] = static_cast<uint8_t>(lanes[i]);
    }
#endif
    for (; k < K; ++k) {
      const float q = std::min(127.f, std::max(-127.f, std::nearbyint(buf[k] / scale)));
      out[k] = static_cast<uint8_t>(static_cast<int>(q) + offset);
    }
  }
  for (; k < k_pad; ++k) out[k] = offset;  // zero activations (an all-zero row, and the padding)
  return scale;
}

// ---- tiles: acc[MT][NB * 16] int32 sums of MT activation rows by NB blocks of 16 output rows ----
// A tile adds the sums over 4-column groups [g0, g1) to acc (loaded and stored back), so a long K is
// cut into chunks whose weights stay in L1 while every activation row of a prefill passes over them.
struct Operands {
  const uint8_t* xq;   // [MT, k_pad] codes of the activations (q or q + 128), first row of the tile
  int64_t k_pad;
  const int8_t* w;     // packed weights, first block of the tile
  int64_t block_bytes; // k_pad * 16
  int64_t g0, g1;
};

#if defined(INT8_AVX512_VNNI)
template <int MT, int NB>
void tile(const Operands& o, int32_t* acc_out) {
  __m512i acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_loadu_si512(acc_out + (i * NB + j) * 16);
  for (int64_t g = o.g0; g < o.g1; ++g) {
    __m512i w[NB];
    for (int j = 0; j < NB; ++j) w[j] = _mm512_loadu_si512(o.w + j * o.block_bytes + g * 64);
    for (int i = 0; i < MT; ++i) {
      int32_t x4;
      std::memcpy(&x4, o.xq + i * o.k_pad + g * kDepth, 4);
      const __m512i xb = _mm512_set1_epi32(x4);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xb, w[j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_si512(acc_out + (i * NB + j) * 16, acc[i][j]);
}
// Decode (M < 8): 4 activation rows x 64 output rows. Prefill: 8 x 32, 10% faster here (one thread,
// 128-512 rows of this model's shapes: 300 against 270 GOPS; 6 x 64 spills registers and runs at 180).
constexpr int kMaxMT = 8, kMaxNB = 4;
inline void tile_shape(int64_t M, int* mt, int* nb) {
  *mt = M < 8 ? 4 : 8;
  *nb = M < 8 ? 4 : 2;
}
#elif defined(INT8_AVX_VNNI) || defined(INT8_AVX2)
// 256-bit registers: a block of 16 rows is two halves of 8 rows (bytes 0-31 and 32-63 of a line)
template <int MT, int NB>
void tile(const Operands& o, int32_t* acc_out) {
  __m256i acc[MT][2 * NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < 2 * NB; ++j)
      acc[i][j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc_out + (i * NB * 2 + j) * 8));
#ifdef INT8_AVX2
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t g = o.g0; g < o.g1; ++g) {
    for (int j = 0; j < 2 * NB; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o.w + (j / 2) * o.block_bytes + g * 64 + (j % 2) * 32));
#ifdef INT8_AVX2
      const __m256i w_abs = _mm256_sign_epi8(w, w);  // -128 stays 0x80, read as 128 by vpmaddubsw
#endif
      for (int i = 0; i < MT; ++i) {
        int32_t x4;
        std::memcpy(&x4, o.xq + i * o.k_pad + g * kDepth, 4);
        const __m256i xb = _mm256_set1_epi32(x4);
#if defined(INT8_AVX_VNNI) && defined(__AVXVNNI__)
        acc[i][j] = _mm256_dpbusd_avx_epi32(acc[i][j], xb, w);
#elif defined(INT8_AVX_VNNI)
        acc[i][j] = _mm256_dpbusd_epi32(acc[i][j], xb, w);
#else
        const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xb, w));
        acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(pairs, ones));
#endif
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < 2 * NB; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc_out + (i * NB * 2 + j) * 8), acc[i][j]);
}
constexpr int kMaxMT = 4, kMaxNB = 1;
#endif
#if !defined(INT8_AVX512_VNNI)
inline void tile_shape(int64_t, int* mt, int* nb) {
  *mt = kMaxMT;
  *nb = kMaxNB;
}
#endif

// the same sums in plain loops, over the codes as the compiled path stores them (q + 128 on the VNNI
// paths, whose epilogue subtracts 128 * colsum)
void tile_scalar(const Operands& o, int mt, int nb, int32_t* acc_out) {
  for (int i = 0; i < mt; ++i) {
    for (int j = 0; j < nb * kBlockRows; ++j) {
      const int8_t* w = o.w + (j / kBlockRows) * o.block_bytes + (j % kBlockRows) * kDepth;
      const uint8_t* x = o.xq + i * o.k_pad;
      int32_t sum = 0;
      for (int64_t g = o.g0; g < o.g1; ++g)
        for (int d = 0; d < kDepth; ++d)
#ifdef INT8_UNSIGNED_ACTIVATIONS
          sum += static_cast<int>(x[g * kDepth + d]) * w[g * 64 + d];
#else
          sum += static_cast<int>(static_cast<int8_t>(x[g * kDepth + d])) * w[g * 64 + d];
#endif
      acc_out[i * nb * kBlockRows + j] += sum;
    }
  }
}

using TileFn = void (*)(const Operands&, int32_t*);

TileFn pick_tile(int mt, int nb) {
#if defined(INT8_AVX512_VNNI)
  // every shape tile_shape uses and its remainders (at most 16 accumulators)
  static const TileFn table[kMaxMT][kMaxNB] = {
      {tile<1, 1>, tile<1, 2>, tile<1, 3>, tile<1, 4>},
      {tile<2, 1>, tile<2, 2>, tile<2, 3>, tile<2, 4>},
      {tile<3, 1>, tile<3, 2>, tile<3, 3>, tile<3, 4>},
      {tile<4, 1>, tile<4, 2>, tile<4, 3>, tile<4, 4>},
      {tile<5, 1>, tile<5, 2>, nullptr, nullptr},
      {tile<6, 1>, tile<6, 2>, nullptr, nullptr},
      {tile<7, 1>, tile<7, 2>, nullptr, nullptr},
      {tile<8, 1>, tile<8, 2>, nullptr, nullptr}};
  return table[mt - 1][nb - 1];
#elif defined(INT8_AVX_VNNI) || defined(INT8_AVX2)
  static const TileFn table[kMaxMT] = {tile<1, 1>, tile<2, 1>, tile<3, 1>, tile<4, 1>};
  return nb == 1 ? table[mt - 1] : nullptr;
#else
  (void)mt;
  (void)nb;
  return nullptr;
#endif
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& colsum, const at::Tensor& w_scale,
         const c10::optional<at::Tensor>& bias, at::Tensor& y, bool scalar) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t k_pad = w_packed.size(1) / kBlockRows;
  const int64_t num_blocks = w_packed.size(0);
#ifdef INT8_UNSIGNED_ACTIVATIONS
  const bool shift = true;
#else
  const bool shift = false;
#endif
  const int32_t shift_by = shift ? 128 : 0;
  // the pre-pass: [M, k_pad] codes and [M] scales
  std::vector<uint8_t> xq(M * k_pad);
  std::vector<float> sx(M);
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(K);
    for (int64_t m = begin; m < end; ++m)
      sx[m] = quantize_row(xp + m * K, K, k_pad, buf.data(), xq.data() + m * k_pad, shift);
  });

  const int8_t* wp = w_packed.data_ptr<int8_t>();
  const int32_t* cs = colsum.data_ptr<int32_t>();
  const float* ws = w_scale.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  T* yp = y.data_ptr<T>();
  int mt_main, nb_main;
  tile_shape(M, &mt_main, &nb_main);
  if (scalar) nb_main = 1;
  const int64_t num_tiles = (num_blocks + nb_main - 1) / nb_main;
  const int64_t groups = k_pad / kDepth;
  at::parallel_for(0, num_tiles, 1, [&](int64_t tile_begin, int64_t tile_end) {
    // int32 sums of up to kChunkRows activation rows by the tile's nb * 16 output rows
    std::vector<int32_t> acc(std::min<int64_t>(M, kChunkRows) * nb_main * kBlockRows);
    std::vector<float> row_out(nb_main * kBlockRows);
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      const int64_t b0 = t * nb_main;
      const int nb = static_cast<int>(std::min<int64_t>(nb_main, num_blocks - b0));
      const int64_t n0 = b0 * kBlockRows;
      const int64_t rows = std::min<int64_t>(nb * kBlockRows, N - n0);
      const int64_t width = nb * kBlockRows;  // acc row stride
      for (int64_t c0 = 0; c0 < M; c0 += kChunkRows) {
        const int64_t chunk = std::min<int64_t>(kChunkRows, M - c0);
        std::fill(acc.begin(), acc.begin() + chunk * width, 0);
        for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
          const int64_t g1 = std::min<int64_t>(groups, g0 + kChunkGroups);
          for (int64_t m0 = c0; m0 < c0 + chunk; m0 += mt_main) {
            const int mt = static_cast<int>(std::min<int64_t>(mt_main, c0 + chunk - m0));
            const Operands o{xq.data() + m0 * k_pad, k_pad, wp + b0 * k_pad * kBlockRows, k_pad * kBlockRows, g0, g1};
            int32_t* a = acc.data() + (m0 - c0) * width;
            TileFn fn = scalar ? nullptr : pick_tile(mt, nb);
            if (fn) fn(o, a);
            else tile_scalar(o, mt, nb, a);
          }
        }
        // the epilogue, in float32 and in the reference's order: ((sum - 128 colsum) * s_x) * s_w + bias
        for (int64_t i = 0; i < chunk; ++i) {
          const float s = sx[c0 + i];
          const int32_t* a = acc.data() + i * width;
          float* v = row_out.data();
          for (int64_t r = 0; r < rows; ++r) v[r] = static_cast<float>(a[r] - shift_by * cs[n0 + r]) * s * ws[n0 + r];
          if (bp)
            for (int64_t r = 0; r < rows; ++r) v[r] += bp[n0 + r];
          T* out = yp + (c0 + i) * N + n0;
          for (int64_t r = 0; r < rows; ++r) out[r] = static_cast<T>(v[r]);
        }
      }
    }
  });
}

// y [M, N] = W8A8(x [M, K]); w_packed int8 [N_pad / 16, k_pad * 16]; colsum int32 [N_pad]; w_scale float [N_pad]
void int8_linear(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& colsum,
                 const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias, at::Tensor y, int64_t impl) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(w_packed.scalar_type() == at::kChar && w_packed.is_contiguous() && w_packed.dim() == 2,
              "w_packed must be contiguous int8 [N_pad / 16, k_pad * 16]");
  const int64_t k_pad = w_packed.size(1) / kBlockRows;
  TORCH_CHECK(w_packed.size(1) % (kBlockRows * kDepth) == 0 && k_pad >= x.size(1) && k_pad < x.size(1) + kDepth,
              "w_packed's width does not match x's K rounded up to a multiple of 4");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.size(0) == x.size(0) && y.scalar_type() == x.scalar_type(),
              "y must be contiguous [M, N] in x's dtype");
  TORCH_CHECK(y.size(1) <= w_packed.size(0) * kBlockRows && y.size(1) > (w_packed.size(0) - 1) * kBlockRows,
              "y's N does not match w_packed's blocks");
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.is_contiguous() && colsum.numel() >= y.size(1), "bad colsum");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() >= y.size(1),
              "w_scale must be contiguous float32 [N]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() >= y.size(1),
                "bias must be contiguous float32 [N]");
  const bool scalar = impl == kScalar;
  switch (x.scalar_type()) {
    case at::kFloat: run<float>(x, w_packed, colsum, w_scale, bias, y, scalar); break;
    case at::kBFloat16: run<at::BFloat16>(x, w_packed, colsum, w_scale, bias, y, scalar); break;
    case at::kHalf: run<at::Half>(x, w_packed, colsum, w_scale, bias, y, scalar); break;
    default: TORCH_CHECK(false, "int8_linear supports float32, bfloat16 and float16 activations");
  }
}

// the ISA path compiled in: avx512_vnni, avx_vnni, avx2 or scalar
std::string isa_path() {
#if defined(INT8_AVX512_VNNI)
  return "avx512_vnni";
#elif defined(INT8_AVX_VNNI)
  return "avx_vnni";
#elif defined(INT8_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// the codes the pre-pass stores for x (q, or q + 128 on the VNNI paths) and the scales: for tests
std::vector<at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kByte));
  at::Tensor s = at::empty({M}, x.options());
  std::vector<float> buf(K);
#ifdef INT8_UNSIGNED_ACTIVATIONS
  const bool shift = true;
#else
  const bool shift = false;
#endif
  for (int64_t m = 0; m < M; ++m)
    s.data_ptr<float>()[m] = quantize_row(x.data_ptr<float>() + m * K, K, K, buf.data(), q.data_ptr<uint8_t>() + m * K, shift);
  return {q, s};
}

}  // namespace

// every kernel runs without the GIL: a server's event loop and tokenizer thread go on while a step
// computes (the arguments are converted before the call and the result after it, both with the GIL)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const pybind11::call_guard<pybind11::gil_scoped_release> no_gil{};
  m.def("int8_linear", &int8_linear, "W8A8 linear: per-token int8 activations times packed int8 weights (CPU)",
        no_gil, pybind11::arg("x"), pybind11::arg("w_packed"), pybind11::arg("colsum"), pybind11::arg("w_scale"),
        pybind11::arg("bias"), pybind11::arg("y"), pybind11::arg("impl"));
  m.def("quantize_activations", &quantize_activations, "the pre-pass alone: (codes uint8 [M, K], scales [M])",
        no_gil);
  m.def("isa_path", &isa_path, "the ISA path compiled in: avx512_vnni, avx_vnni, avx2 or scalar");
  m.def("unsigned_activations", []() {
#ifdef INT8_UNSIGNED_ACTIVATIONS
    return true;
#else
    return false;
#endif
  }, "whether the pre-pass stores q + 128 (the VNNI paths)");
}
