// Multi-LoRA shrink and expand for x86 CPUs: every adapter of a forward pass in one call each.
//
// lora_a [L, R, in] and lora_b [L, out, R] stack L adapter slots (R: the rank rows of every output slice).
// The adapter tokens of a pass are rows[i] of x and y, with slot row_slots[i]:
//   shrink: t[i, :] = lora_a[slot_i] @ x[rows[i]]          t: fp32 [n, R]
//   expand: y[rows[i], :] += lora_b[slot_i] @ t[i]          rounded once to y's dtype
// Both dot rows of activations with rows of a weight ([N, K], K contiguous), in tiles of kTileRows tokens x 4
// weight rows held in fp32 accumulators. The tokens are grouped by slot first, so a tile of weight rows is read
// once per adapter and chunk of 16 of its tokens (Punica's SGMV for a prefill; for decodes each adapter's few
// tokens share its rows). bf16 weights stay bf16 in memory and are widened in registers; bf16 activations are
// widened once into a scratch by the shrink. Work items (a chunk of one adapter's tokens x a block of 64 weight
// rows, the product's output rows) are split over OpenMP threads with at::parallel_for; small products stay on
// the calling thread.
//
// The ISA path is fixed when the file is compiled (AVX-512, AVX2 + FMA + F16C, or portable scalar code);
// pagoda builds it for the CPU it runs on, so the path is chosen at run time by which build is loaded.

#include "pagoda_torch.h"
#include "pagoda_float.h"
#include <ATen/ops/empty.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PAGODA_LORA_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGODA_LORA_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using pagoda::from_f;
using pagoda::to_f;

// ---- one ISA's vector: kLanes fp32 lanes; sum4 reduces four of them to four floats ---------------

#if defined(PAGODA_LORA_AVX512)
struct Vec {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kTileRows = 4;  // 16 accumulators of 32 registers
  static const char* name() { return "avx512"; }
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const at::BFloat16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load_part(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static V load_part(const at::BFloat16* p, int n) { return widen(_mm256_maskz_loadu_epi16(mask(n), p)); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void sum4(V a, V b, V c, V d, float* out) { sum4_256(half(a), half(b), half(c), half(d), out); }

 private:
  static __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static V widen(__m256i bf16) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16)); }
  static __m256 half(V v) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return _mm256_add_ps(_mm512_castps512_ps256(v), hi);
  }
  static void sum4_256(__m256 a, __m256 b, __m256 c, __m256 d, float* out) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // [a b c d | a b c d] partials
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
};
#elif defined(PAGODA_LORA_AVX2)
struct Vec {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kTileRows = 2;  // 8 accumulators of 16 registers: the weight and token loads need the rest
  static const char* name() { return "avx2"; }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const at::BFloat16* p) { return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V load_part(const float* p, int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
  }
  static V load_part(const at::BFloat16* p, int n) {  // no 16-bit masked load on AVX2: through a zeroed buffer
    alignas(16) uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(uint16_t));
    return widen(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void sum4(V a, V b, V c, V d, float* out) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // [a b c d | a b c d] partials
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }

 private:
  static V widen(__m128i bf16) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16), 16)); }
};
#else
struct Vec {  // portable: one lane, what the compiler makes of it
  using V = float;
  static constexpr int kLanes = 1;
  static constexpr int kTileRows = 2;
  static const char* name() { return "scalar"; }
  static V zero() { return 0.f; }
  template <typename T> static V load(const T* p) { return to_f(*p); }
  template <typename T> static V load_part(const T* p, int) { return to_f(*p); }
  static V fma(V a, V b, V c) { return a * b + c; }
  static void sum4(V a, V b, V c, V d, float* out) { out[0] = a; out[1] = b; out[2] = c; out[3] = d; }
};
#endif

// sums[m][j] = dot(x[m][0:K], w[j][0:K]) for MR activation rows and 4 weight rows
template <int MR, typename TX, typename TW>
inline void dot_tile(const TX* const* x, const TW* const* w, int64_t K, float (*sums)[4]) {
  using V = typename Vec::V;
  V acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = Vec::zero();
  int64_t k = 0;
  for (; k + Vec::kLanes <= K; k += Vec::kLanes) {
    const V w0 = Vec::load(w[0] + k), w1 = Vec::load(w[1] + k), w2 = Vec::load(w[2] + k), w3 = Vec::load(w[3] + k);
    for (int m = 0; m < MR; ++m) {
      const V xv = Vec::load(x[m] + k);
      acc[m][0] = Vec::fma(xv, w0, acc[m][0]);
      acc[m][1] = Vec::fma(xv, w1, acc[m][1]);
      acc[m][2] = Vec::fma(xv, w2, acc[m][2]);
      acc[m][3] = Vec::fma(xv, w3, acc[m][3]);
    }
  }
  if (k < K) {  // the last K % kLanes columns, through masked loads (zeros beyond K)
    const int n = static_cast<int>(K - k);
    const V w0 = Vec::load_part(w[0] + k, n), w1 = Vec::load_part(w[1] + k, n);
    const V w2 = Vec::load_part(w[2] + k, n), w3 = Vec::load_part(w[3] + k, n);
    for (int m = 0; m < MR; ++m) {
      const V xv = Vec::load_part(x[m] + k, n);
      acc[m][0] = Vec::fma(xv, w0, acc[m][0]);
      acc[m][1] = Vec::fma(xv, w1, acc[m][1]);
      acc[m][2] = Vec::fma(xv, w2, acc[m][2]);
      acc[m][3] = Vec::fma(xv, w3, acc[m][3]);
    }
  }
  for (int m = 0; m < MR; ++m) Vec::sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3], sums[m]);
}

template <typename TX, typename TW>
inline void dot_tile_rows(int mr, const TX* const* x, const TW* const* w, int64_t K, float (*sums)[4]) {
  switch (mr) {
    case 1: dot_tile<1>(x, w, K, sums); break;
    case 2: dot_tile<2>(x, w, K, sums); break;
#if defined(PAGODA_LORA_AVX512)
    case 3: dot_tile<3>(x, w, K, sums); break;
    case 4: dot_tile<4>(x, w, K, sums); break;
#endif
    default: break;
  }
}

// The dots of tokens x[0:M] (pointers, one per token) with weight rows [n0, n1) of w ([N, K]):
// emit(m, n, sum) for each.
template <typename TX, typename TW, typename Emit>
void dot_rows(const TX* const* x, int64_t M, const TW* w, int64_t n0, int64_t n1, int64_t K, Emit&& emit) {
  float sums[Vec::kTileRows][4];
  for (int64_t n = n0; n < n1; n += 4) {
    const int nw = static_cast<int>(std::min<int64_t>(4, n1 - n));
    const TW* wr[4];
    for (int j = 0; j < 4; ++j) wr[j] = w + (n + std::min(j, nw - 1)) * K;  // a short tile repeats its last row
    for (int64_t m = 0; m < M; m += Vec::kTileRows) {
      const int mr = static_cast<int>(std::min<int64_t>(Vec::kTileRows, M - m));
      dot_tile_rows(mr, x + m, wr, K, sums);
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nw; ++j) emit(m + i, n + j, sums[i][j]);
    }
  }
}

// ---- the adapter tokens, grouped by slot -------------------------------------------------------

struct Groups {
  std::vector<int64_t> order;   // [n]: indices into rows, slot by slot (ascending within a slot)
  std::vector<int64_t> starts;  // [num_segments + 1]: segment s is order[starts[s]:starts[s + 1]]
  std::vector<int64_t> slots;   // [num_segments]: its slot
};

Groups group_by_slot(const at::Tensor& rows, const at::Tensor& row_slots, int64_t num_slots, int64_t num_tokens) {
  TORCH_CHECK(rows.dim() == 1 && row_slots.dim() == 1 && rows.size(0) == row_slots.size(0),
              "rows and row_slots must be 1-D of one length");
  TORCH_CHECK(rows.scalar_type() == at::kLong && row_slots.scalar_type() == at::kLong,
              "rows and row_slots must be int64");
  const at::Tensor r = rows.contiguous(), s = row_slots.contiguous();
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t n = r.size(0);
  std::vector<int64_t> counts(num_slots + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "row_slots[", i, "] = ", sp[i], " is not a slot in [0, ",
                num_slots, ")");
    TORCH_CHECK(rp[i] >= 0 && rp[i] < num_tokens, "rows[", i, "] = ", rp[i], " is not a token in [0, ",
                num_tokens, ")");
    ++counts[sp[i] + 1];
  }
  Groups g;
  std::vector<int64_t> next(num_slots + 1, 0);
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    next[slot + 1] = next[slot] + counts[slot + 1];
    if (counts[slot + 1] > 0) {
      g.slots.push_back(slot);
      g.starts.push_back(next[slot]);
    }
  }
  g.starts.push_back(n);
  g.order.resize(n);
  for (int64_t i = 0; i < n; ++i) g.order[next[sp[i]]++] = i;
  return g;
}

// A product's work item: tokens [m0, m1) of one segment (positions in Groups::order) x weight rows [n0, n1).
// Items cut the tokens into chunks and the weight rows into blocks small enough for L1 (the chunk's activation
// rows and the block's weight rows are read once per item, the tiles loop inside it).
struct Item {
  int64_t seg, m0, m1, n0, n1;
};

constexpr int64_t kChunkTokens = 16;
constexpr int64_t kBlockRows = 64;
// multiply-adds per parallel chunk of items: about this many, so decodes stay on one thread
constexpr int64_t kMacsPerTask = 65536;

std::vector<Item> make_items(const Groups& g, int64_t N) {
  std::vector<Item> items;
  for (int64_t n0 = 0; n0 < N; n0 += kBlockRows)  // output rows outermost: threads take ranges of them
    for (size_t seg = 0; seg < g.slots.size(); ++seg)
      for (int64_t m0 = g.starts[seg]; m0 < g.starts[seg + 1]; m0 += kChunkTokens)
        items.push_back({static_cast<int64_t>(seg), m0, std::min(m0 + kChunkTokens, g.starts[seg + 1]), n0,
                         std::min(n0 + kBlockRows, N)});
  return items;
}

// fn(item) for every item, over OpenMP threads when the product (n tokens x N rows x K) is large enough
template <typename Fn>
void run_items(const std::vector<Item>& items, int64_t n, int64_t N, int64_t K, Fn&& fn) {
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t per_item = std::max<int64_t>(1, n * N * K / std::max<int64_t>(1, num_items));
  at::parallel_for(0, num_items, std::max<int64_t>(1, kMacsPerTask / per_item), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(items[i]);
  });
}

void check_weight(const at::Tensor& w, const char* name, const at::Tensor& act) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous(), name, " must be a contiguous [max_loras, rows, cols] tensor");
  TORCH_CHECK(w.scalar_type() == act.scalar_type(), name, " is ", w.scalar_type(), " but the activations are ",
              act.scalar_type(), "; both must be of the model's dtype");
}

void check_act(const at::Tensor& a, const char* name, int64_t width) {
  TORCH_CHECK(a.dim() == 2 && a.stride(1) == 1, name, " must be a 2-D tensor with contiguous rows");
  TORCH_CHECK(a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16, name, " is ", a.scalar_type(),
              "; the cpu LoRA kernel takes float32 or bfloat16");
  TORCH_CHECK(a.size(1) == width, name, " has ", a.size(1), " columns, the adapter weights ", width);
}

// ---- shrink and expand ---------------------------------------------------------------------

template <typename T>
void shrink_impl(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& rows, const Groups& g,
                 at::Tensor& t) {
  const int64_t n = rows.size(0), R = lora_a.size(1), K = lora_a.size(2), ldx = x.stride(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const T* xp = x.data_ptr<T>();
  float* tp = t.data_ptr<float>();
  // the tokens' rows, slot by slot: as they are for fp32, widened once into a scratch for bf16
  std::vector<const float*> xr(n);
  std::vector<float> scratch;
  if (std::is_same<T, float>::value) {
    for (int64_t p = 0; p < n; ++p) xr[p] = reinterpret_cast<const float*>(xp + rp[g.order[p]] * ldx);
  } else {
    scratch.resize(n * K);
    for (int64_t p = 0; p < n; ++p) {
      const T* src = xp + rp[g.order[p]] * ldx;
      float* dst = scratch.data() + p * K;
      for (int64_t k = 0; k < K; ++k) dst[k] = to_f(src[k]);
      xr[p] = dst;
    }
  }
  const T* ap = lora_a.data_ptr<T>();
  const int64_t* order = g.order.data();
  run_items(make_items(g, R), n, R, K, [&](const Item& it) {
    dot_rows(xr.data() + it.m0, it.m1 - it.m0, ap + g.slots[it.seg] * R * K, it.n0, it.n1, K,
             [&](int64_t m, int64_t r, float v) { tp[order[it.m0 + m] * R + r] = v; });
  });
}

template <typename T>
void expand_impl(const at::Tensor& t, const at::Tensor& lora_b, const at::Tensor& rows, const Groups& g,
                 at::Tensor& y) {
  const int64_t n = rows.size(0), N = lora_b.size(1), R = lora_b.size(2), ldy = y.stride(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const float* tp = t.data_ptr<float>();
  std::vector<const float*> tr(n);
  for (int64_t p = 0; p < n; ++p) tr[p] = tp + g.order[p] * R;
  const T* bp = lora_b.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t* order = g.order.data();
  run_items(make_items(g, N), n, N, R, [&](const Item& it) {
    dot_rows(tr.data() + it.m0, it.m1 - it.m0, bp + g.slots[it.seg] * N * R, it.n0, it.n1, R,
             [&](int64_t m, int64_t o, float v) {
               T* out = yp + rp[order[it.m0 + m]] * ldy + o;
               *out = from_f<T>(to_f(*out) + v);
             });
  });
}

at::Tensor shrink_with(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& rows, const Groups& g) {
  at::Tensor t = at::empty({rows.size(0), lora_a.size(1)}, x.options().dtype(at::kFloat));
  if (rows.size(0) == 0) return t;
  if (x.scalar_type() == at::kFloat) {
    shrink_impl<float>(x, lora_a, rows, g, t);
  } else {
    shrink_impl<at::BFloat16>(x, lora_a, rows, g, t);
  }
  return t;
}

void expand_with(const at::Tensor& t, const at::Tensor& lora_b, const at::Tensor& rows, const Groups& g,
                 at::Tensor& y) {
  if (rows.size(0) == 0) return;
  if (y.scalar_type() == at::kFloat) {
    expand_impl<float>(t, lora_b, rows, g, y);
  } else {
    expand_impl<at::BFloat16>(t, lora_b, rows, g, y);
  }
}

void check_t(const at::Tensor& t, const at::Tensor& rows, int64_t rank) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.scalar_type() == at::kFloat,
              "t must be a contiguous float32 [num_lora_tokens, rank] tensor (what lora_shrink returns)");
  TORCH_CHECK(t.size(0) == rows.size(0) && t.size(1) == rank, "t is [", t.size(0), ", ", t.size(1), "] but ",
              rows.size(0), " adapter tokens of rank ", rank, " need [", rows.size(0), ", ", rank, "]");
}

// t [n, R] fp32 = lora_a[row_slots[i]] @ x[rows[i]] for every adapter token i
at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& rows,
                       const at::Tensor& row_slots) {
  check_act(x, "x", lora_a.size(2));
  check_weight(lora_a, "lora_a", x);
  const Groups g = group_by_slot(rows, row_slots, lora_a.size(0), x.size(0));
  return shrink_with(x, lora_a, rows.contiguous(), g);
}

// y[rows[i]] += lora_b[row_slots[i]] @ t[i] for every adapter token i (y in place)
void lora_expand(at::Tensor y, const at::Tensor& t, const at::Tensor& lora_b, const at::Tensor& rows,
                 const at::Tensor& row_slots) {
  check_act(y, "y", lora_b.size(1));
  check_weight(lora_b, "lora_b", y);
  check_t(t, rows, lora_b.size(2));
  const Groups g = group_by_slot(rows, row_slots, lora_b.size(0), y.size(0));
  expand_with(t, lora_b, rows.contiguous(), g, y);
}

// both: y[rows[i]] += lora_b[s] @ (lora_a[s] @ x[rows[i]]), s = row_slots[i]; the tokens grouped once
void lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                const at::Tensor& rows, const at::Tensor& row_slots) {
  check_act(x, "x", lora_a.size(2));
  check_act(y, "y", lora_b.size(1));
  check_weight(lora_a, "lora_a", x);
  check_weight(lora_b, "lora_b", y);
  TORCH_CHECK(lora_a.size(0) == lora_b.size(0) && lora_a.size(1) == lora_b.size(2),
              "lora_a and lora_b disagree on the slots or the rank");
  TORCH_CHECK(x.size(0) == y.size(0), "x has ", x.size(0), " tokens, y ", y.size(0));
  const Groups g = group_by_slot(rows, row_slots, lora_a.size(0), x.size(0));
  const at::Tensor r = rows.contiguous();
  const at::Tensor t = shrink_with(x, lora_a, r, g);
  expand_with(t, lora_b, r, g, y);
}

std::string isa_path() { return Vec::name(); }

}  // namespace

// The tensors are converted before each call and the result after it, both with the GIL; the
// computation in between runs without it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const pybind11::call_guard<pybind11::gil_scoped_release> no_gil{};
  m.def("lora_shrink", &lora_shrink, "t [n, R] fp32 = lora_a[row_slots[i]] @ x[rows[i]]", no_gil,
        pybind11::arg("x"), pybind11::arg("lora_a"), pybind11::arg("rows"), pybind11::arg("row_slots"));
  m.def("lora_expand", &lora_expand, "y[rows[i]] += lora_b[row_slots[i]] @ t[i], in place", no_gil,
        pybind11::arg("y"), pybind11::arg("t"), pybind11::arg("lora_b"), pybind11::arg("rows"),
        pybind11::arg("row_slots"));
  m.def("lora_apply", &lora_apply, "shrink then expand, the tokens grouped by slot once", no_gil,
        pybind11::arg("y"), pybind11::arg("x"), pybind11::arg("lora_a"), pybind11::arg("lora_b"),
        pybind11::arg("rows"), pybind11::arg("row_slots"));
  m.def("isa_path", &isa_path, "the ISA path compiled in: avx512, avx2 or scalar");
}
